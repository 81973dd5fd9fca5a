"""`croupier serve` under cProfile in every Python thread, timing CPU, not wall time.

    python -m croupier.bench.profserve OUT.json serve DATASET ... [serve flags]

Each thread (the event loop, the I/O pool's readers, the CPU pool) gets its own
`cProfile.Profile` timed by its CPU clock (`pthread_getcpuclockid`) as it starts (`threading.setprofile`), so a function's
time is the CPU its thread spent in it, system time of its syscalls included (a pread
through FUSE, a futex), and not the time it slept waiting for storage. When the server
exits (SIGTERM: its graceful shutdown), the profiles are merged and OUT.json gets the
top functions by self and by inclusive CPU time, the CPU by thread group, and the
process's user and system CPU seconds (what is left over ran outside Python threads:
grpc's C core, uvloop's I/O); with CROUPIER_PROFSERVE_PSTATS=FILE, FILE gets the merged
profile itself, for pstats' callers and callees. A sampling profiler (py-spy) falls behind on a server with
a thousand I/O threads; this counts every call instead, at the cost of slowing Python
calls down (the shares, not the absolute rate, are what it is for).
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import re
import sys
import threading
import time
from typing import Any

_profiles: list[tuple[str, cProfile.Profile]] = []
_lock = threading.Lock()


def _thread_timer() -> Any:
    """This thread's CPU clock, readable from any thread (the merge at exit runs in the main
    thread and closes the calls still open in the others with their own clock)."""
    clock = time.pthread_getcpuclockid(threading.get_ident())
    last = [0.0]

    def now() -> float:
        try:
            last[0] = time.clock_gettime(clock)
        except OSError:  # the thread has ended
            pass
        return last[0]

    return now


def _start_in_thread(frame: Any, event: str, arg: Any) -> None:
    """threading.setprofile hook: the first event in a new thread installs its profiler."""
    sys.setprofile(None)
    p = cProfile.Profile(_thread_timer())
    with _lock:
        _profiles.append((threading.current_thread().name, p))
    p.enable()


def _group(name: str) -> str:
    return re.sub(r"[-_ ]?\d+$", "", re.sub(r" \(.*\)$", "", name)) or name


def _cpu() -> tuple[float, float]:
    t = os.times()
    return t.user, t.system


def _merged(profiles: list[tuple[str, cProfile.Profile]]) -> pstats.Stats | None:
    merged: pstats.Stats | None = None
    for _, p in profiles:
        try:
            st = pstats.Stats(p)
        except TypeError:  # a profile that never recorded anything
            continue
        if merged is None:
            merged = st
        else:
            merged.add(st)
    return merged


def summarize(profiles: list[tuple[str, cProfile.Profile]], top: int = 25) -> dict[str, Any]:
    by_thread: dict[str, float] = {}
    for name, p in profiles:
        try:
            by_thread[_group(name)] = by_thread.get(_group(name), 0.0) + pstats.Stats(p).total_tt
        except TypeError:  # a profile that never recorded anything
            continue
    merged = _merged(profiles)
    rows: list[dict[str, Any]] = []
    if merged is not None:
        for (file, line, func), (cc, nc, tt, ct, _callers) in merged.stats.items():  # type: ignore[attr-defined]
            short = file
            for marker in ("site-packages/", "/server/", "/client/", "/croupier/", "/lib/python3"):
                if marker in file:
                    short = file[file.index(marker) + 1:] if marker.startswith("/") else file.split(marker, 1)[1]
                    break
            rows.append({"function": f"{func} ({short}:{line})" if line else func, "calls": nc, "self_s": tt,
                         "inclusive_s": ct})
    total = sum(by_thread.values())
    files: dict[str, float] = {}
    for r in rows:
        f = r["function"].rsplit(" (", 1)[1].rsplit(":", 1)[0] if " (" in r["function"] else "(built-in)"
        files[f] = files.get(f, 0.0) + r["self_s"]
    return {
        "python_cpu_s": total,
        "by_file": sorted(([k, v] for k, v in files.items()), key=lambda kv: -kv[1])[:top],
        "threads": sorted(([k, v] for k, v in by_thread.items()), key=lambda kv: -kv[1]),
        "self": sorted(rows, key=lambda r: -r["self_s"])[:top],
        "inclusive": sorted(rows, key=lambda r: -r["inclusive_s"])[:top],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out, args = argv[0], argv[1:]
    from croupier.cli import main as cli_main

    u0, s0 = _cpu()
    t0 = time.perf_counter()
    threading.setprofile(_start_in_thread)
    main_profile = cProfile.Profile(_thread_timer())
    with _lock:
        _profiles.append(("MainThread", main_profile))
    main_profile.enable()
    try:
        rc = cli_main(args)
    finally:
        main_profile.disable()
        threading.setprofile(None)
        u1, s1 = _cpu()
        with _lock:
            profiles = list(_profiles)
        for _, p in profiles:
            try:
                p.disable()  # only affects the calling thread; the others have ended or are idle
            except Exception:
                pass
        summary = summarize(profiles)
        summary.update({"process_user_s": u1 - u0, "process_system_s": s1 - s0, "wall_s": time.perf_counter() - t0,
                        "threads_profiled": len(profiles)})
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)
        raw, merged = os.environ.get("CROUPIER_PROFSERVE_PSTATS"), _merged(profiles)
        if raw and merged is not None:  # for pstats' callers and callees (`python -m pstats FILE`)
            merged.dump_stats(raw)
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
