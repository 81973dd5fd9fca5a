"""What every suite's report shares: the run's header (command, revision, machine, load), the
way its tables write a number, and the form of a target's verdict.

A report is a JSON-able dict. `run_header` gives the facts known at the start of a run,
`close_header` adds those known at its end, and `header_lines` writes them as the opening
lines of the report's Markdown: every committed result says the same things about how it
was made, in the same words.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

#: The checkout the harness runs from (bench/ sits in its root): git is asked about this one.
CHECKOUT = Path(__file__).resolve().parents[1]
#: The folders whose uncommitted changes would make a run measure something other than its
#: revision: the product, its protocol and the harness (its results apart: a run writes them).
CODE_PATHS = ("server", "client", "croupier", "protos", "bench", ":(exclude)bench/results")


def num(x: Any, fmt: str = ",.0f") -> str:
    """`x` in `fmt`, or "-" where there is no figure (None, NaN, infinite)."""
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "-"
    return format(x, fmt)


def target(name: str, measured: float | None, want: float, detail: str) -> dict[str, Any]:
    """A suite's target as the reports list it: met when `measured` is at least `want`."""
    return {"target": name, "measured": None if measured is None else float(measured), "want": want,
            "met": bool(measured is not None and measured >= want), "detail": detail}  # numpy bools are no JSON


def git(*args: str) -> str:
    """`git ARGS` in the harness's checkout: its output (trailing blanks cut), "" when git cannot say."""
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=CHECKOUT).stdout.rstrip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def revision(short: bool = False) -> str:
    """The commit checked out (40 hex digits, or git's short form), or "unknown"."""
    return git("rev-parse", *(["--short"] if short else []), "HEAD") or "unknown"


def code_state() -> str:
    """The commit measured, and which code paths had uncommitted changes (shared checkouts)."""
    status = git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
    dirty = [line[3:] for line in status.splitlines() if line.strip()]
    return revision(short=True) + (f" with uncommitted changes in {', '.join(dirty)}" if dirty else "")


def machine() -> dict[str, Any]:
    """CPU model, cores, memory, OS, and the versions of what the figures depend on."""
    import grpc
    import pyarrow
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    mem_kb = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count() or 1, "memory_gb": mem_kb / 2**20,
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "torch": torch.__version__, "grpcio": grpc.__version__, "pyarrow": pyarrow.__version__}


def load_average() -> list[float]:
    """The machine's load average over 1, 5 and 15 minutes."""
    return list(os.getloadavg())


def utc(when: float | None = None) -> str:
    """A time (seconds since the epoch; now by default) as the reports write it."""
    t = datetime.datetime.now(datetime.timezone.utc) if when is None else \
        datetime.datetime.fromtimestamp(when, datetime.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M UTC")


def run_header(command: str) -> dict[str, Any]:
    """The header's facts at the start of a run: command, machine, code state, revision,
    start time and load average (under "load" -> "start")."""
    return {"command": command, "machine": machine(), "code": code_state(), "revision": revision(),
            "started": utc(), "load": {"start": load_average()}}


def close_header(rep: dict[str, Any], t0: float) -> None:
    """The header's facts at the end of a run begun at perf_counter `t0`: the load average
    (under "load" -> "end"), the wall time, and an error in rep["errors"] if the code
    changed meanwhile (another session's edit in a shared checkout)."""
    rep["load"]["end"] = load_average()
    now = code_state()
    if now != rep["code"]:
        rep.setdefault("errors", []).append(f"the code changed during the run: {rep['code']} at the start, "
                                            f"{now} at the end")
    rep["wall_s"] = time.perf_counter() - t0


def header_lines(rep: dict[str, Any]) -> list[str]:
    """The report's opening lines (Markdown, ending in a blank line): command, run, machine, load.
    Facts an older report's JSON lacks are left out of their line."""
    wall = f"{rep['wall_s'] / 60:.1f} min wall" if rep.get("wall_s") is not None else ""
    when = ", ".join(x for x in (rep.get("started", ""), wall) if x)
    run = [x for x in (when, rep.get("revision") and f"revision {rep['revision']}",
                       rep.get("code") and f"code: {rep['code']}") if x]
    lines = [f"Command: `{rep['command']}`  "]
    if run:
        lines.append(f"Run: {'; '.join(run)}  ")
    m = rep.get("machine")
    if m:
        lines.append(f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']:.0f} GiB, {m['os']}; "
                     f"Python {m['python']}, torch {m['torch']}, grpcio {m['grpcio']}, pyarrow {m['pyarrow']}  ")
    load = rep.get("load") or {}
    if isinstance(load, list):  # older autotune reports: one reading, at the end
        load = {"end": load}
    at = [(when, load[when]) for when in ("start", "end") if load.get(when)]
    if at:
        over = "1, 5, 15 min" if len(at[0][1]) == 3 else "1 min"
        values = "; ".join(f"at {when} {', '.join(f'{x:.2f}' for x in xs)}" for when, xs in at)
        lines.append(f"Load average ({over}) {values} (the machine is shared: other processes may have taken CPU "
                     "during the run).")
    lines[-1] = lines[-1].rstrip()
    return [*lines, ""]
