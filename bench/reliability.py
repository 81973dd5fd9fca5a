"""`croupier bench --suite reliability`: the reliability report (issue 13, item 8).

Runs the fuzzer and the fault harness at the report's sizes against real `croupier serve`
processes on loopback and writes `reliability.{md,json}` with the command, the machine and
the code revision. Each figure reads "N faults: L lost, D duplicated" or "N requests: C
crashes, H hangs", as the tests assert them at smaller sizes.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import abuse, faults
from .fuzz import fuzz
from .driver import drive
from .reporting import header_lines


def _fuzz_section(workdir: Path, count: int, say: Callable[[str], None]) -> dict[str, Any]:
    from croupier.client import Loader
    from croupier.demo.data import prepare
    from croupier.demo.procs import ServerProcess

    digits = prepare(workdir / "digits").root
    server = ServerProcess(["rows=synthetic:5000:64", f"table={digits}/arrow/train.arrow",
                            f"images={digits}/imagefolder/train"], workdir, ["--grace", "0", "--drain-notice", "0"],
                           name="fuzz-server").start()
    try:
        report = asyncio.run(fuzz(server.address, ["rows", "table", "images"], seed=0, count=count,
                                  progress=lambda n, total: say(f"  fuzz: {n:,}/{total:,}")))
        say("  " + report.summary())
        loader = Loader("rows", servers=[server.address], batch_size=64, seed=1)
        seen = [i for b in loader.batches() for i in b.indices[~b.padding].tolist()]
        epoch_ok = sorted(seen) == list(range(5000))
        alive = server.proc is not None and server.proc.poll() is None
        tracebacks = server.log.read_text(errors="replace").count("Traceback")
    finally:
        server.stop()
    by_code: Counter = Counter()
    for (_, code), n in report.statuses.items():
        by_code[code] += n
    return {"requests": report.requests, "seconds": report.seconds, "hangs": len(report.hangs),
            "vague": len(report.vague), "vague_examples": report.vague[:10], "alive_after": report.alive_after and alive,
            "epoch_after_complete": epoch_ok, "tracebacks_in_log": tracebacks, "statuses": dict(by_code),
            "by_method": {f"{m} {c}": n for (m, c), n in sorted(report.statuses.items())}}


CASE_TESTS = ("tests/test_confinement.py", "tests/test_corrupt_data.py")


def _case_tests(say: Callable[[str], None]) -> dict[str, Any]:
    """Items 2 and 6 are pass/fail cases on a real server, kept as tests: run them here
    (from a checkout) and count each case's verdict."""
    import re
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]  # bench/ sits in the checkout's root
    files = [str(repo / f) for f in CASE_TESTS if (repo / f).exists()]
    if not files:
        return {"skipped": "no tests/ folder beside the package (run from a checkout)"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *files],
                          cwd=repo, capture_output=True, text=True, timeout=900)
    verdicts = re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED) (\S+)", done.stdout, flags=re.M)
    cases = [{"test": name.split("::", 1)[-1], "file": name.split("::", 1)[0], "verdict": v} for v, name in verdicts]
    say(f"  {sum(c['verdict'] == 'PASSED' for c in cases)} of {len(cases)} cases passed")
    return {"cases": cases, "returncode": done.returncode}


def run_reliability(out: Path, command: str, say: Callable[[str], None] = print, *, fuzz_requests: int = 10_000,
                    replica_kills: int = 20, cuts: int = 20, trainer_kills: int = 10,
                    abuse_streams: int = 2000) -> dict[str, Any]:
    """Runs the report's sections at these sizes and writes reliability.json and .md under `out`."""

    def measure(rep: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="croupier-reliability-") as tmp:
            work = Path(tmp)
            say(f"fuzzing {fuzz_requests:,} requests")
            rep["fuzz"] = _fuzz_section(work / "fuzz", fuzz_requests, say)
            rep["faults"] = _faults_section(work, say, replica_kills, cuts, trainer_kills)
            rep["abuse"] = _abuse_section(work / "abuse", say, abuse_streams)
            say("confinement and corrupt data: their test cases")
            rep["cases"] = _case_tests(say)

    return drive("reliability", out, command, measure, lambda rep, _plots: markdown(rep), say=say)


def _faults_section(work: Path, say: Callable[[str], None], replica_kills: int, cuts: int,
                    trainer_kills: int) -> list[dict[str, Any]]:
    out = []
    for name, run in (
        ("replica", lambda: faults.replica_churn(work / "replica", kills=replica_kills, seed=1, rows=6000,
                                                 log=lambda s: say("  " + s))),
        ("cuts", lambda: faults.connection_cuts(work / "cuts", cuts=cuts, seed=2, rows=6000,
                                                log=lambda s: say("  " + s))),
        ("trainer", lambda: faults.trainer_kills(work / "trainer", kills=trainer_kills, seed=3, rows=6000,
                                                 log=lambda s: say("  " + s))),
    ):
        say(f"faults: {name}")
        result = run()
        say("  " + result.summary())
        out.append({"name": name, **{k: getattr(result, k) for k in (
            "what", "faults", "expected", "delivered", "lost", "duplicated", "reconnects", "seconds")}})
    return out


def _abuse_section(work: Path, say: Callable[[str], None], streams: int) -> list[dict[str, Any]]:
    out = []
    for label, flags in (("default limits", ()),
                         ("limits raised to admit them all", ("--max-streams-per-client", "5000",
                                                              "--max-streams-per-connection", "5000",
                                                              "--max-streams", "5000"))):
        say(f"abuse: {streams:,} stalled streams, {label}")
        out.append({"label": label, **abuse.stalled_streams(work, attempts=streams, log=say, extra_args=flags)})
    return out


def markdown(rep: dict[str, Any]) -> str:
    f = rep["fuzz"]
    lines = [
        "# Reliability report",
        "",
        *header_lines(rep),
        "Every server here is a real `croupier serve` process on 127.0.0.1; every trainer a real `Loader`.",
        "",
        "## Figures",
        "",
        f"- **Fuzz:** {f['requests']:,} fuzzed requests to every RPC: "
        f"{0 if f['alive_after'] else 1} crashes, {f['hangs']} hangs (calls past their deadline), "
        f"{f['vague']} UNKNOWN/INTERNAL answers, {f['tracebacks_in_log']} tracebacks in the server log; "
        f"a normal epoch afterwards {'completed with every sample' if f['epoch_after_complete'] else 'FAILED'} "
        f"({f['seconds']:.0f} s of fuzz).",
    ]
    for r in rep["faults"]:
        lines.append(f"- **{r['what'][0].upper() + r['what'][1:]}:** {r['faults']} faults over an epoch of "
                     f"{r['expected']:,} samples: {r['lost']} lost, {r['duplicated']} duplicated "
                     f"({r['reconnects']} reconnects; {r['seconds']:.0f} s).")
    for a in rep.get("abuse", []):
        o, other = a["outcome"], a["other_client"]
        refused = sum(n for k, n in o.items() if k != "admitted")
        lines.append(f"- **{a['attempts']:,} streams opened by one client and never read** ({a['label']}): "
                     f"{o.get('admitted', 0):,} admitted, {refused:,} refused ({', '.join(f'{k} {n:,}' for k, n in o.items() if k != 'admitted') or 'none'}); "
                     f"another client's epoch {'complete' if other['complete'] else 'INCOMPLETE'} "
                     f"({other['delivered']:,} of {other['expected']:,} samples, {other['distinct']:,} distinct); "
                     f"server CPU with only the stalled streams open {a['stalled_cpu_percent']:.1f}%, "
                     f"RSS {a['server_rss_mb']:.0f} MB.")
    cases = rep.get("cases", {}).get("cases", [])
    if cases:
        passed = sum(c["verdict"] == "PASSED" for c in cases)
        lines.append(f"- **Confinement and corrupt data:** {passed} of {len(cases)} cases hold (each a layout or a "
                     "corrupt file on a real server; see below).")
    lines += ["", "## Fuzz answers by status", "", "| status | requests |", "|---|---:|"]
    lines += [f"| {code} | {n:,} |" for code, n in sorted(f["statuses"].items(), key=lambda kv: -kv[1])]
    lines += ["", "## How each figure is made", "",
              "- Fuzz (`bench/fuzz.py`, seed 0): random bytes, mutated valid requests, requests with "
              "extreme or hostile values (sizes 0 and 2^32-1, ranks outside the world, names of 64 KiB, NULs, "
              "`../`, absolute paths, thousands of columns) and valid ones, to StreamEpoch, DescribeDataset, "
              "ListDatasets, Health/Check and unknown methods, 32 at a time, each with a 10 s deadline.",
              "- Replica kills (`faults.replica_churn`): two replicas, two ranks; at 20 random points of the "
              "epoch (each once a stream is open, 20+ batches before the end) the replica serving more ranks gets "
              "SIGKILL or SIGTERM (drawn) and is restarted on its port.",
              "- Connection resets (`faults.connection_cuts`): the trainer reads through a loopback TCP proxy "
              "that resets every connection (RST) at 20 random batches.",
              "- Trainer kills (`faults.trainer_kills`): a trainer process saving `Loader.state_dict()` with its "
              "progress after every batch is SIGKILLed at random batches and restarted from that checkpoint.",
              "- Stalled streams (`bench/abuse.py`): one client (127.0.0.1) opens the streams over 4 "
              "connections with HTTP/2 window growth off and reads only their headers; another client (::1) "
              "reads a whole epoch meanwhile; the server's CPU is its utime+stime ticks over 3 s once only the "
              "stalled streams are left.",
              "- Reads are paced by croupier's injected latency (3 ms, fixed) so an epoch spans the faults; "
              "nothing here measures speed.",
              "",
              "## Confinement and corrupt data (items 2 and 6)", "",
              "Pass/fail cases, each a test on a real server, run by this report "
              "(`tests/test_confinement.py`, `tests/test_corrupt_data.py`): links out of a data root (an image, a "
              "class folder, an `.arrow` file, a `.tar` shard, `classes.txt`, `state.json` naming `../` or an "
              "absolute path), files swapped after open, a planted link under the tar index's name; truncated, "
              "empty and mis-typed datasets at start, a flipped byte in a checksummed Parquet page, a mixed-format "
              "folder, a JPEG with garbage after its header. Each is refused with the status the README gives, "
              "and a control case shows the same layout really serves outside bytes when the check is off.",
              "",
              *[f"- {c['verdict']}: `{c['file'].rsplit('/', 1)[-1]}::{c['test']}`" for c in cases],
              "",
              "## What is not covered", "",
              "- A network that stops delivering without resetting (a black hole): the client sees it only "
              "through gRPC keepalive, after its timeout; not run here.",
              "- Faults of the storage under the server (a file system or object store failing mid-read) are "
              "covered by tests of DATA_LOSS and retries, not by this report.",
              "- Several faults at the same moment (both replicas down at once) are covered by "
              "tests/test_failover.py, not counted here.",
              ""]
    return "\n".join(lines)
