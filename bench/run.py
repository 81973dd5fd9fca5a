"""The matrix suites (full, first, quick: suites.py) end to end: data, decode ceiling, cases,
curves, shuffle quality, targets; report.py writes their Markdown and plots.py their plots."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import curves as curves_mod
from . import plots, report
from .cases import Case, run_case
from .datagen import ensure_data
from .decode import DecodeCeiling
from .driver import Report, attempt, drive
from .suites import Curves, Suite


def run_suite(suite: Suite, out: Path, data_dir: Path, command: str, say: Callable[[str], None] = print,
              only: str = "") -> Report:
    """Runs `suite` (only the cases whose "dataset storage system" contains `only`, and then no
    curves) and writes `<suite>.json`, `.md` and the plots under `out`."""
    return drive(suite.name, out, command, lambda rep: measure(suite, rep, data_dir, say, only),
                 report.markdown, plots.all_plots, say)


def measure(suite: Suite, rep: Report, data_dir: Path, say: Callable[[str], None], only: str = "") -> None:
    """The suite's figures into `rep`: its cases (ceilings and comparisons derived), and unless
    `only` narrows the cases, its curves and shuffle quality; then its targets."""
    log = Path(tempfile.gettempdir()) / f"croupier-bench-{suite.name}-server.log"  # not a result: kept out of `out`
    log.write_text("")
    rep.update(data=asdict(suite.data), batch=suite.cases[0].batch if suite.cases else 64,
               world=suite.cases[0].world if suite.cases else 2)
    paths = ensure_data(data_dir, suite.data, log=say).paths()
    decode = DecodeCeiling(paths, suite.decode_seconds, say)
    cases = [c for c in suite.cases if not only or only in f"{c.dataset} {c.storage.name} {c.system.label}"]
    results = [r for i, case in enumerate(cases, 1) if (r := _one_case(rep, case, i, len(cases), paths, log, say))]
    rates = decode.end(rep, say)
    results = [report.derive(r, rates, rep["machine"]["cores"]) for r in results]
    report.finish(results)
    rep["cases"] = results
    if suite.curves is not None and not only:
        rep["curves"] = _curves(suite.curves, suite.data.text_rows, paths, log, say)
        if suite.shuffle_quality:
            rep["shuffle_quality"] = _shuffle_quality(suite.curves.shuffle_rows, say)
    for kind in suite.targets:
        rep["targets"] = report.check_targets(kind, results)


def _one_case(rep: Report, case: Case, i: int, n: int, paths: dict[str, Path], log: Path,
              say: Callable[[str], None]) -> dict[str, Any] | None:
    what = f"{case.dataset} | {case.storage.name} | {case.system.label}"
    say(f"[{i}/{n}] {what} ...")
    t = time.perf_counter()
    result = attempt(rep, what, lambda: run_case(case, paths, log), say)
    if result is None:
        return None
    r = result.as_dict()
    rep["errors"] += [f"{what}: {w}" for w in r["extra"].get("warnings", [])]
    say(f"    {r['samples_per_s']:,.0f} samples/s, first batch {r['first_batch_s']:.2f} s, "
        f"batch p99 {r['batch_p99_ms']:.0f} ms ({time.perf_counter() - t:.1f} s)")
    return r


def _curves(c: Curves, text_rows: int, paths: dict[str, Path], log: Path, say: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {"in_flight_latency_ms": c.in_flight_latency_ms, "streams_latency_ms": c.streams_latency_ms}
    say("curve: throughput against reads in flight")
    out["reads_in_flight"] = curves_mod.reads_in_flight(c, paths, log, say)
    say("curve: throughput against concurrent streams")
    out["streams"] = curves_mod.concurrent_streams(c, paths, text_rows, log, say)
    say("curve: planner time and memory against dataset size")
    out["planner"] = curves_mod.planner_scaling(c, say)
    return out


def _shuffle_quality(rows: int, say: Callable[[str], None]) -> dict[str, Any]:
    from croupier.shuffle_quality import markdown_table, report_rows

    say("shuffle quality")
    figures, expected = report_rows(n=rows)
    return {"rows": [{**r.figures.as_dict(), "pvalues": r.pvalues, "uniform": r.uniform} for r in figures],
            "expected": expected, "markdown": markdown_table(figures, expected)}
