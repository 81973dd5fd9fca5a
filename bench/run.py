"""Run a suite end to end: data, decode ceiling, cases, curves, shuffle quality, outputs."""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import curves as curves_mod
from . import plots, report
from .cases import run_case
from .datagen import ensure_data
from .decode import decode_rates
from .suites import Suite


def machine() -> dict[str, Any]:
    import grpc
    import pyarrow
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    mem_kb = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count() or 1, "memory_gb": mem_kb / 2**20,
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "torch": torch.__version__, "grpcio": grpc.__version__, "pyarrow": pyarrow.__version__}


def code_state() -> str:
    """The commit measured, and which code paths had uncommitted changes (shared checkouts)."""
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    status = git("status", "--porcelain", "--untracked-files=no", "--", "server", "client", "croupier", "protos")
    dirty = [line[3:] for line in status.splitlines() if line.strip()]
    return head + (f" with uncommitted changes in {', '.join(dirty)}" if dirty else "")


def run_suite(suite: Suite, out: Path, data_dir: Path, command: str, say: Callable[[str], None] = print,
              only: str = "") -> dict[str, Any]:
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    import tempfile

    log = Path(tempfile.gettempdir()) / f"croupier-bench-{suite.name}-server.log"  # not a result: kept out of `out`
    log.write_text("")
    rep: dict[str, Any] = {
        "suite": suite.name, "command": command, "machine": machine(), "code": code_state(),
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load": {"start": list(os.getloadavg())}, "data": asdict(suite.data),
        "batch": suite.cases[0].batch if suite.cases else 64, "world": suite.cases[0].world if suite.cases else 2,
        "errors": [],
    }
    data = ensure_data(data_dir, suite.data, log=say)
    paths = data.paths()
    rates = decode_rates(paths, suite.decode_seconds)
    say("decode rate, one core: " + ", ".join(f"{k} {v:,.0f} samples/s" for k, v in rates.items()))
    cases = [c for c in suite.cases if not only or only in f"{c.dataset} {c.storage.name} {c.system.label}"]
    results: list[dict[str, Any]] = []
    for i, case in enumerate(cases, 1):
        what = f"{case.dataset} | {case.storage.name} | {case.system.label}"
        say(f"[{i}/{len(cases)}] {what} ...")
        t = time.perf_counter()
        try:
            r = run_case(case, paths, log).as_dict()
        except Exception as exc:  # one failed case is reported; the suite carries on
            rep["errors"].append(f"{what}: {exc}")
            say(f"    failed: {exc}")
            continue
        results.append(r)
        rep["errors"] += [f"{what}: {w}" for w in r["extra"].get("warnings", [])]
        say(f"    {r['samples_per_s']:,.0f} samples/s, first batch {r['first_batch_s']:.2f} s, "
            f"batch p99 {r['batch_p99_ms']:.0f} ms ({time.perf_counter() - t:.1f} s)")
    # Measured again at the end: on a shared machine the CPU's best showing is its ceiling.
    again = decode_rates(paths, suite.decode_seconds)
    rep["decode_rates_measured"] = {"start": rates, "end": again}
    rep["decode_rates"] = rates = {k: max(v, again[k]) for k, v in rates.items()}
    say("decode rate at the end: " + ", ".join(f"{k} {v:,.0f} samples/s" for k, v in again.items()))
    results = [report.derive(r, rates, rep["machine"]["cores"]) for r in results]
    report.finish(results)
    rep["cases"] = results
    if suite.curves is not None and not only:
        c = suite.curves
        rep["curves"] = {"in_flight_latency_ms": c.in_flight_latency_ms, "streams_latency_ms": c.streams_latency_ms}
        say("curve: throughput against reads in flight")
        rep["curves"]["reads_in_flight"] = curves_mod.reads_in_flight(c, paths, log, say)
        say("curve: throughput against concurrent streams")
        rep["curves"]["streams"] = curves_mod.concurrent_streams(c, paths, suite.data.text_rows, log, say)
        say("curve: planner time and memory against dataset size")
        rep["curves"]["planner"] = curves_mod.planner_scaling(c, say)
    if suite.shuffle_quality and suite.curves is not None and not only:
        from croupier.shuffle_quality import markdown_table, report_rows

        say("shuffle quality")
        rows, expected = report_rows(n=suite.curves.shuffle_rows)
        rep["shuffle_quality"] = {
            "rows": [{**r.figures.as_dict(), "pvalues": r.pvalues, "uniform": r.uniform} for r in rows],
            "expected": expected, "markdown": markdown_table(rows, expected)}
    for kind in suite.targets:
        rep["targets"] = report.check_targets(kind, results)
    rep["load"]["end"] = list(os.getloadavg())
    if code_state() != rep["code"]:
        rep["errors"].append(f"the code changed during the run: {rep['code']} at the start, {code_state()} at the end")
    rep["wall_s"] = time.perf_counter() - t0
    made = plots.all_plots(rep, out, suite.name)
    (out / f"{suite.name}.json").write_text(json.dumps(rep, indent=1, default=str))
    (out / f"{suite.name}.md").write_text(report.markdown(rep, made))
    say(f"wrote {out / (suite.name + '.md')}, {out / (suite.name + '.json')} and {len(made)} plots "
        f"in {rep['wall_s'] / 60:.1f} min")
    for t in rep.get("targets", []):
        say(f"  target {'met' if t['met'] else 'NOT met'}: {t['target']}: {t['detail']}")
    return rep
