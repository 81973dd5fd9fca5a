"""The one way a suite runs: its header, its measurements, its outputs.

Every suite (`croupier bench --suite ...`, and the `python -m croupier.bench.<x>`
benchmarks that write a report) is a `measure` function that fills a report dict, and a
`render` that turns the finished report into Markdown (and any plots). `drive` does the
rest the same way for all of them:

1. the header's facts at the start (reporting.run_header) and `errors: []`;
2. `measure(rep)`: a failed case goes into rep["errors"] (see `attempt`), the suite carries on;
3. the header's facts at the end (reporting.close_header);
4. `<out>/<name>.json` first, so the figures are safe if a plot fails; then the plots and
   `<out>/<name>.md`;
5. one line saying what was written, and each target's verdict where the suite has targets.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .reporting import close_header, run_header

Report = dict[str, Any]
T = TypeVar("T")

#: The report's plots under `out` named after `stem`, their paths returned (empty without matplotlib).
Plots = Callable[[Report, Path, str], list[str]]
#: The report's Markdown, given the plots made for it.
Markdown = Callable[[Report, list[str]], str]


def no_plots(rep: Report, out: Path, stem: str) -> list[str]:
    """For suites whose report is tables only."""
    return []


def attempt(rep: Report, what: str, run: Callable[[], T], say: Callable[[str], None]) -> T | None:
    """run()'s result; if it raises, the failure goes into rep["errors"] as "what: error", is
    said, and None comes back: one failed case is reported and the suite carries on."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - any failure of a case is a result to report
        rep["errors"].append(f"{what}: {exc}")
        say(f"    failed: {exc}")
        return None


def drive(name: str, out: Path, command: str, measure: Callable[[Report], None], markdown: Markdown,
          plots: Plots = no_plots, say: Callable[[str], None] = print) -> Report:
    """Run one suite and write `<out>/<name>.json`, its plots and `<out>/<name>.md` (see the
    module's docstring for the order). Returns the report."""
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    rep: Report = {"suite": name, **run_header(command), "errors": []}
    measure(rep)
    close_header(rep, t0)
    (out / f"{name}.json").write_text(json.dumps(rep, indent=1, default=str))
    made = plots(rep, out, name)
    (out / f"{name}.md").write_text(markdown(rep, made))
    say(f"wrote {out / (name + '.md')}, {out / (name + '.json')} and {len(made)} plots "
        f"in {rep['wall_s'] / 60:.1f} min")
    for t in rep.get("targets", []):
        say(f"  target {'met' if t['met'] else 'NOT met'}: {t['target']}: {t['detail']}")
    return rep
