"""The `real` suite's Markdown report and plots (see real.py for what is measured).

    python -m croupier.bench.realreport bench/results/real.json   # rewrite real.md and the plots from the JSON
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

from .bucket_mount import CLIENTS as BUCKET_CLIENTS
from .report import DATASET_TITLES, targets_table
from .reporting import header_lines, num

#: How each system reads, per storage condition: what the comparison is worth.
HOW = {
    "croupier": ("`croupier serve DATASET=MOUNT/...`: rows by range preads (structural pages cached), images as whole "
                 "files, tar members by offset (index beside the shards), on its I/O pool",
                 "`croupier serve DATASET=s3://bench/...`: the same reads as obstore range GETs"),
    "dataloader": ("map-style Dataset over the mount: the save_to_disk Arrow files memory-mapped (pyarrow, as HF "
                   "does), one row sliced per `__getitem__`; images: open + read + decode per file",
                   "text: one ranged GET (pyarrow S3FileSystem) of the Arrow record batch holding the row, decoded, "
                   "row kept (batch offsets given to it beforehand); images: one boto3 `get_object` per image"),
    "hf": ("`datasets.load_from_disk(MOUNT/text).shuffle(seed)` + `split_dataset_by_node` + DataLoader, 2 workers "
           "(memory-mapped)",
           "what `load_from_disk('s3://...')` does: download the folder (boto3 here, 8 files at once; s3fs is not "
           "installed), then as on files; each rank downloads its own copy before its first batch"),
    "webdataset": ("`wds.WebDataset` over the shard paths on the mount, 2 workers (sequential reads, kernel readahead)",
                   "`wds.WebDataset` over the shards' http URLs (its gopen runs curl: one streaming GET per shard)"),
}


def results_table(cases: list[dict[str, Any]], dataset: str) -> str:
    head = ("| storage | system | samples/s | first batch s | storage reads/s | reads / sample | KB / sample "
            "| max reads in flight | CPU s/1k samples (server) | storage CPU s/1k | peak RSS MB server / trainer "
            "(+workers) | ceiling: C/L, CPU | of ceiling (bound) | vs best DataLoader |\n" + "|---" * 14 + "|")
    lines = [head]
    for r in cases:
        if r["case"]["dataset"] != dataset or r["role"] != "measure":
            continue
        s = r["storage"]
        server_cpu = f" ({r['server_cpu_s_per_1k']:.3f})" if r["server_cpu_s_per_1k"] is not None else ""
        workers = f" (+{r['workers_private_rss_mb']:,.0f})" if r["workers_private_rss_mb"] else ""
        ceiling = "-"
        if r.get("ceiling_c_over_l") or r.get("ceiling_cpu"):
            ceiling = f"{num(r.get('ceiling_c_over_l'))}, {num(r.get('ceiling_cpu'))}"
        frac = (f"{100 * r['fraction_of_ceiling']:.0f}% ({r['ceiling_binding']})"
                if r.get("fraction_of_ceiling") is not None else "-")
        vs = r.get("vs_best_dataloader")
        if vs is None and r.get("vs_webdataset") is not None:
            vs_s = f"{r['vs_webdataset']:.2f}x WebDataset"
        else:
            vs_s = f"{vs:.2f}x" if vs is not None else "-"
        lines.append(
            f"| {r['condition']['name']} | {r['label']} | {num(r['samples_per_s'])} | {num(r['first_batch_s'], '.2f')} "
            f"| {num(s.get('steady_reads_per_s'))} | {num(s.get('reads_per_sample'), '.2f')} "
            f"| {num(s['bytes_per_sample'] / 1024 if s.get('counted') else None, ',.1f')} "
            f"| {num(s.get('max_in_flight'))} | {r['cpu_s_per_1k']:.3f}{server_cpu} | {num(s.get('cpu_s_per_1k'), '.3f')} "
            f"| {num(r['server_peak_rss_mb'])} / {r['trainer_peak_rss_mb']:,.0f}{workers} | {ceiling} | {frac} | {vs_s} |")
    return "\n".join(lines)


def ceilings_table(cases: list[dict[str, Any]]) -> str:
    lines = ["| dataset | run | samples/s | first batch s | CPU s/1k samples (server) | peak RSS MB server / trainer |",
             "|---|---|---|---|---|---|"]
    seen: dict[str, int] = {}
    for r in cases:
        if r["role"] != "cpu ceiling":
            continue
        ds = r["case"]["dataset"]
        seen[ds] = seen.get(ds, 0) + 1
        lines.append(f"| {ds} | {'start' if seen[ds] == 1 else 'end'} | {num(r['samples_per_s'])} "
                     f"| {num(r['first_batch_s'], '.2f')} | {r['cpu_s_per_1k']:.3f} ({num(r['server_cpu_s_per_1k'], '.3f')}) "
                     f"| {num(r['server_peak_rss_mb'])} / {r['trainer_peak_rss_mb']:,.0f} |")
    return "\n".join(lines)


def cpu_budget_table(cases: list[dict[str, Any]]) -> str:
    """Per croupier unordered case: CPU per 1,000 samples by process (the server's by
    thread), the cores that makes at the measured rate, and at 70% of the ceiling."""
    lines = ["| dataset | storage | samples/s | server: event loop | read threads | other threads | trainers | storage "
             "| cores busy | 70% of ceiling | cores it would take |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in cases:
        if r["role"] != "measure" or r["label"] != "croupier unordered" or not r.get("ceiling"):
            continue
        n = max(r.get("samples") or 0, 1)
        groups = (r.get("extra") or {}).get("server_threads_cpu_s") or {}
        per = lambda pred: sum(g.get("cpu", 0.0) for k, g in groups.items() if pred(k)) / n * 1000  # noqa: E731
        loop = per(lambda k: k.startswith("main thread"))
        reads = per(lambda k: k.startswith(("native read", "tokio")))
        server = r.get("server_cpu_s_per_1k") or 0.0
        other = max(server - loop - reads, 0.0)
        trainers = r["cpu_s_per_1k"] - server
        storage = (r.get("storage") or {}).get("cpu_s_per_1k") or 0.0
        total = server + trainers + storage
        target = 0.7 * r["ceiling"]
        lines.append(f"| {r['case']['dataset']} | {r['condition']['name']} | {num(r['samples_per_s'])} | {loop:.3f} | "
                     f"{reads:.3f} | {other:.3f} | {trainers:.3f} | {storage:.3f} | "
                     f"{r['samples_per_s'] * total / 1000:.2f} | {num(target)} | {target * total / 1000:.2f} |")
    return "\n".join(lines)


def glance_table(cases: list[dict[str, Any]]) -> str:
    """croupier unordered against the best DataLoader (WebDataset for the tar shards), per dataset and slow
    storage; HF datasets beside."""
    lines = ["| dataset | storage | croupier unordered samples/s | of its ceiling | best DataLoader (WebDataset for "
             "shards) samples/s | croupier x | reads / sample croupier vs it | HF datasets samples/s (first batch s) |",
             "|---|---|---|---|---|---|---|---|"]
    for ds in DATASET_TITLES:
        for cond in dict.fromkeys(r["condition"]["name"] for r in cases if r["role"] == "measure"):
            rows = [r for r in cases if r["role"] == "measure" and r["case"]["dataset"] == ds
                    and r["condition"]["name"] == cond]
            cr = next((r for r in rows if r["label"] == "croupier unordered"), None)
            kind = "webdataset" if ds == "shards" else "dataloader"
            base = [r for r in rows if r["case"]["system"]["kind"] == kind]
            if cr is None or not base:
                continue
            b = max(base, key=lambda r: r["samples_per_s"])
            hf = next((r for r in rows if r["case"]["system"]["kind"] == "hf"), None)
            frac = f"{100 * cr['fraction_of_ceiling']:.0f}% ({cr['ceiling_binding']})" \
                if cr.get("fraction_of_ceiling") is not None else "-"
            name = b["label"].replace("DataLoader + DistributedSampler, ", "DataLoader ")
            hf_s = f"{hf['samples_per_s']:,.0f} ({hf['first_batch_s']:.1f})" if hf else "-"
            lines.append(f"| {ds} | {cond} | {num(cr['samples_per_s'])} | {frac} | {num(b['samples_per_s'])} ({name}) "
                         f"| {cr['samples_per_s'] / max(b['samples_per_s'], 1e-9):.1f}x "
                         f"| {num(cr['storage'].get('reads_per_sample'), '.2f')} vs "
                         f"{num(b['storage'].get('reads_per_sample'), '.2f')} | {hf_s} |")
    return "\n".join(lines)


def threads_table(groups: dict[str, dict[str, float]], samples: int) -> list[str]:
    def cpu_of(g: dict[str, float]) -> float:  # reports before 'cpu' (schedstat) was recorded: the tick sum
        return g.get("cpu", g["user"] + g["system"])

    total = sum(cpu_of(g) for g in groups.values()) or 1e-9
    lines = ["| thread group | threads | CPU s | user / system (ticks) | share | CPU ms per 1k samples |",
             "|---|---|---|---|---|---|"]
    for name, g in sorted(groups.items(), key=lambda kv: -cpu_of(kv[1])):
        cpu = cpu_of(g)
        if cpu < 0.005:
            continue
        lines.append(f"| {name} | {int(g['threads'])} | {cpu:.2f} | {g['user']:.2f} / {g['system']:.2f} | "
                     f"{cpu / total:.0%} | {1e6 * cpu / max(samples, 1):,.0f} |")
    return lines


def profile_section(p: dict[str, Any], measured: dict[str, Any] | None) -> list[str]:
    lines: list[str] = []
    if measured is not None and measured["extra"].get("server_threads_cpu_s"):
        groups = measured["extra"]["server_threads_cpu_s"]
        lines += [f"Server CPU by thread in the measured case (*{measured['condition']['name']}*, croupier unordered, "
                  f"{measured['samples_per_s']:,.0f} samples/s, {measured['samples']:,} samples; from "
                  "/proc/PID/task/*/schedstat, no profiler; user / system are the tick counts of .../stat, which round "
                  "each thread down by up to 10 ms and so miss most of the short-running read threads' time):", ""]
        lines += threads_table(groups, measured["samples"]) + [""]
    user, system = p.get("process_user_s") or 0.0, p.get("process_system_s") or 0.0
    lines += [f"Functions: a second run of *{p['case']}* with the server under `python -m croupier.bench.profserve` "
              "(cProfile in every thread, each timed by its thread's CPU clock, so a pread's system time counts and "
              f"its sleep in the storage does not). Profiling slows Python calls down: {p['samples_per_s']:,.0f} "
              f"samples/s under it ({p['samples']:,} samples), so the shares lean towards call-heavy code; the "
              f"calls per sample are exact. Server process CPU during it: {user:.1f} s user, {system:.1f} s system; "
              f"in profiled Python threads: {p.get('python_cpu_s') or 0:.1f} s. (py-spy was tried first, on a revision "
              "whose server ran ~900 Python I/O threads: it fell seconds behind at 10 samples/s and halved the "
              "throughput.)", ""]
    if p.get("threads"):
        lines += ["| thread group (profiled run) | CPU s | share |", "|---|---|---|"]
        lines += [f"| {name} | {cpu:.2f} | {share:.0%} |" for name, cpu, share in p["threads"] if cpu >= 0.005]
        lines.append("")
    for title, key in (("Self CPU (the function's own time)", "self"),
                       ("Inclusive CPU (the function and what it called)", "inclusive")):
        rows = p.get(key) or []
        if key == "inclusive":  # the entry points (cli main, asyncio's run) hold everything: not news
            rows = [r for r in rows if not (r["calls_per_sample"] < 0.001 and r["share"] > 0.5)]
        if not rows:
            continue
        lines += [f"**{title}**", "", "| share of Python CPU | CPU ms per 1k samples | calls per sample | function |",
                  "|---|---|---|---|"]
        lines += [f"| {r['share']:.1%} | {r['cpu_ms_per_1k']:,.0f} | {r['calls_per_sample']:.2f} | `{r['function']}` |"
                  for r in rows]
        lines.append("")
    if p.get("by_file"):
        lines += ["**Self CPU by source file**", "", "| share of Python CPU | CPU ms per 1k samples | file |", "|---|---|---|"]
        lines += [f"| {r['share']:.1%} | {r['cpu_ms_per_1k']:,.0f} | `{r['file']}` |" for r in p["by_file"]]
        lines.append("")
    return lines


def _by(cases: list[dict[str, Any]], ds: str, cond_key: str, label: str, cold: bool = False) -> dict[str, Any] | None:
    return next((r for r in cases if r["role"] == "measure" and r["case"]["dataset"] == ds and r["label"] == label
                 and r["condition"]["key"] == cond_key and bool(r["condition"].get("evict_every_s")) == cold), None)


def reading_notes(rep: dict[str, Any]) -> list[str]:
    """What to keep in mind reading the tables, with this run's numbers."""
    cases = rep.get("cases", [])
    notes: list[str] = []
    ceil = [r for r in cases if r["role"] == "cpu ceiling" and r["case"]["dataset"] == "text"]
    if ceil:
        best = max(ceil, key=lambda r: r["samples_per_s"])
        notes.append(f"croupier's CPU ceiling for the text rows at this revision is {best['samples_per_s']:,.0f} "
                     f"samples/s (page-cache files, nothing to wait for; server {best['server_cpu_s_per_1k']:.3f} CPU s "
                     "per 1,000 samples, most of it on its event-loop thread): every text figure of croupier below is "
                     "bounded by it, whatever the storage allows (C/L).")
    dl, dl_cold = _best_dl(cases, "text", False), _best_dl(cases, "text", True)
    if dl and dl_cold:
        notes.append(f"On the latency FS, memory-mapped readers fault 128 KB of read-around per row, so the 1 GB "
                     f"table warms into the page cache within seconds: {dl['label']} reached "
                     f"{dl['samples_per_s']:,.0f} samples/s at {dl['storage']['reads_per_sample']:.2f} storage reads "
                     f"per sample; with the cache dropped every {dl_cold['condition']['evict_every_s']:g} s (a data set "
                     f"much larger than memory) the best DataLoader made {dl_cold['samples_per_s']:,.0f} samples/s at "
                     f"{dl_cold['storage']['reads_per_sample']:.2f} reads and "
                     f"{dl_cold['storage']['bytes_per_sample'] / 1024:,.0f} KB per sample.")
    hf = _by(cases, "text", "s3", "HF datasets .shuffle() + DataLoader, 2 workers")
    if hf:
        notes.append(f"HF datasets on S3 downloads the whole folder before its first batch ({hf['first_batch_s']:.1f} s "
                     f"here, each rank its own ~1 GB copy), then reads local files: its {hf['samples_per_s']:,.0f} "
                     "samples/s are a page-cache rate, possible only for a data set that fits on the trainer's disk.")
    s3dl = _by(cases, "text", "s3", "DataLoader + DistributedSampler, 8 workers")
    if s3dl:
        notes.append(f"The text DataLoader on S3 fetches the whole Arrow record batch holding each row (1,000 rows, "
                     f"{s3dl['storage']['bytes_per_sample'] / 1024:,.0f} KB per sample at the storage); reading only "
                     "the row's bytes takes the offsets croupier's reader works out from the IPC metadata.")
    if any(r["condition"]["key"] == "s3" for r in cases):
        # obstore's runtime starts for the listing at open either way: GETs through it cost far more
        tokio = any(((r.get("extra") or {}).get("server_threads_cpu_s") or {}).get("tokio-rt-worker", {}).get("cpu", 0.0)
                    > 0.01 * max(r.get("samples") or 0, 1) / 1000 for r in cases if r["condition"]["key"] == "s3")
        client = ("obstore client threads (`tokio-rt-worker` in the JSON's `server_threads_cpu_s`)" if tokio else
                  "S3 GETs, signed, written and parsed on its event loop (server/storage/s3http.py),")
        notes.append("The S3 server runs on the same 2 cores as everything else: its CPU (the *storage CPU* column) "
                     "comes out of the trainers' and croupier's, which a remote store would not take; croupier's "
                     f"{client} are its own.")
    wds = _by(cases, "shards", "s3", "WebDataset, 2 workers")
    if wds:
        notes.append("WebDataset streams each shard front to back (one GET or a few large reads per 1,000 samples) and "
                     "shuffles within a 1,000-sample buffer: it pays the latency once per shard, which is why it "
                     "keeps up on slow storage, at the price of a local shuffle; croupier reads each member "
                     "by its own range read to deal a global permutation.")
    return notes


def _best_dl(cases: list[dict[str, Any]], ds: str, cold: bool) -> dict[str, Any] | None:
    rs = [r for r in cases if r["role"] == "measure" and r["case"]["dataset"] == ds and r["condition"]["key"] == "fuse"
          and r["case"]["system"]["kind"] == "dataloader" and bool(r["condition"].get("evict_every_s")) == cold
          and not r["condition"].get("max_background") == 0]
    return max(rs, key=lambda r: r["samples_per_s"]) if rs else None


def markdown(rep: dict[str, Any], plots: list[str]) -> str:
    cores = rep["machine"]["cores"]
    spec = rep["data"]
    conds = rep.get("conditions", {})
    lines = [
        f"# croupier bench: suite `{rep['suite']}` (really slow storage)",
        "",
        *header_lines(rep),
        f"Data: {spec['text_rows']:,} text rows (id, label, {spec['text_words']} words, {spec['tokens']} int32 tokens: "
        f"about 1 KB each) written by `datasets` save_to_disk"
        + (f" ({rep['text_record_batches']['files']} Arrow stream files, record batches of "
           f"{rep['text_record_batches']['rows_per_batch']:,} rows, {rep['text_record_batches']['mean_batch_bytes'] / 1e6:.2f} MB)"
           if rep.get("text_record_batches") else "")
        + f"; {spec['images']:,} {spec['image_size']}x{spec['image_size']} RGB JPEGs (about 2.2 KB each) as an "
        f"ImageFolder tree and as WebDataset tar shards of {spec['shard_size']:,}. Batch {rep['batch']}, "
        f"{rep['world']} trainer ranks (one process each, side by side), seed 0. Every system reads the same files "
        "through the same storage; no loader injects latency.",
        "",
        "## Storage",
        "",
    ]
    for name, c in conds.items():
        if c["key"] == "fuse" and c.get("evict_every_s"):
            lines.append(f"- **{name}**: the same mount, for text only, with the dataset's cached pages also dropped "
                         f"every {c['evict_every_s']:g} s during the case (the same `fs.evict()`): the 1 GB of rows fits "
                         "in this machine's page cache, and memory-mapped readers' 128 KB read-around fills it within "
                         "seconds, which a data set much larger than memory would not allow. Cache misses: "
                         f"{c['eviction']}.")
        elif c["key"] == "fuse":
            lines.append(f"- **{name}**: latencyfs (bench/native, C FUSE passthrough) of the data folder; every "
                         f"read request sleeps a lognormal draw, median {c['median_ms']:g} ms, sigma {c['sigma']:g}, "
                         f"seed {c['seed']} (mean {c['mean_ms']:.2f} ms). Cache misses: {c['eviction']}."
                         + (" croupier's tar offset index was written beside the shards (`<shard>.idx.json`, from "
                            f"the local folder, {c['tar_index_s']:.1f} s) before the cases, as a deployment ships it; "
                            "its server reads it through the mount at start." if c.get("tar_index_s") else ""))
        elif c["key"] == "s3":
            lines.append(f"- **{name}**: the loopback S3 server (bench/s3server.py, its own process) serving "
                         f"the data folder as bucket `bench`; every request waits a lognormal draw, median "
                         f"{c['median_ms']:g} ms, sigma {c['sigma']:g}, seed {c['seed']} (mean {c['mean_ms']:.2f} ms), "
                         f"in the server. Cache: {c['eviction']}."
                         + (f" croupier's tar offset index of the S3 shards was built once before the cases "
                            f"({c['tar_index_s']:.1f} s, `--cache-dir`)." if c.get("tar_index_s") else ""))
        elif c["key"] in BUCKET_CLIENTS:
            how = ("`rclone mount` with its defaults (no VFS cache: reads go to the bucket as ranged GETs)"
                   if c["key"] == "rclone" else "`s3fs` with its defaults (but for the endpoint, path-style "
                   "requests and a password file of its own)")
            lines.append(f"- **{name}**: the same loopback S3 server and latency (median {c['median_ms']:g} ms, "
                         f"sigma {c['sigma']:g}), its bucket mounted by {how}, as users reach a bucket through a "
                         "mount (bench/bucket_mount.py). Every system reads the mount's paths, croupier too; "
                         f"croupier on the bucket's `s3://` URLs is the S3 row. Cache: {c['eviction']}.")
        else:
            lines.append(f"- **{name}**: plain local files, {c['eviction']}: croupier's CPU ceiling.")
    for s in rep.get("skipped", []):
        lines.append(f"- skipped: {s}")
    flags = " ".join(rep.get("server_flags") or []) or "none"
    lines += [
        "",
        f"croupier: a fresh `croupier serve` per case with its default flags (`--max-reads-per-stream 256`, "
        f"`--prefetch 16`, `--io-threads 1024`); flags added for slow storage: {flags} (plus `--metrics-port 0` to "
        "read its storage counters, and `--cache-dir` on S3 for the tar index).",
        "",
        "| system | on the latency FS | on S3 |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {a} | {b} |" for k, (a, b) in HOW.items()]
    lim = rep.get("limits", {})
    lines += [
        "",
        "Figures: *samples/s*: steady state at the trainer, as the other suites measure it (each rank's batches "
        "after its warm-up ones over the time they took, summed over ranks); each rank stops after "
        f"{lim.get('max_batches', '?')} batches, or {lim.get('max_seconds', '?')} s after its first batch once it has "
        f"enough batches past its warm-up, or {lim.get('hard_seconds', '?')} s after its first batch, or at the end "
        f"of its epoch ({spec['images'] // max(rep['world'], 1):,} images per rank). *First batch*: from building the loader (modules imported; "
        "croupier's server already started: its start, dataset open included, is in the JSON as `server_start_s`) "
        "to the first batch. *Storage reads/s*: requests the storage served per second in the steady window "
        "(counters polled every 0.1 s and interpolated). *Reads / sample*, *KB / sample*: requests and bytes the "
        "storage served over the whole case (dataset open, read-ahead and reads never delivered included) over the "
        "samples delivered: the read amplification. *Max reads in flight*: the most requests inside the storage at "
        "once during the case. *CPU s/1k samples*: trainers, their workers and croupier's server (server alone in "
        "brackets); *storage CPU*: the FUSE daemon's or the S3 server's, apart. *Ceiling*: C/L = max reads in "
        "flight at the storage / mean latency, in samples/s (divided by the steady reads per sample); CPU = "
        "croupier on the same files in the page cache, nothing to wait for (the better of the runs at the start "
        "and the end); *of ceiling*: samples/s over the lower of the two (named). *Vs best DataLoader*: over the best "
        "of DataLoader + DistributedSampler with 0, 2, 8 workers on the same dataset and storage (for the tar "
        "shards, over WebDataset).",
        "",
        f"Decode ceiling (images): one core's decode rate with croupier's client decoder (simplejpeg for JPEGs; "
        f"the DataLoader baselines decode with Pillow, as torchvision does), the better of a measurement at the "
        f"start and the end "
        f"({', '.join(f'{k} {v:,.0f}/s' for k, v in rep['decode_rates'].items())}), times {cores} cores.",
        "",
    ]
    if rep.get("targets"):
        lines += ["## Targets", "", targets_table(rep["targets"]), ""]
    if rep.get("cases"):
        lines += ["## At a glance", "", glance_table(rep["cases"]), ""]
        notes = reading_notes(rep)
        if notes:
            lines += ["Reading these numbers:", ""] + [f"- {n}" for n in notes] + [""]
    for ds, title in DATASET_TITLES.items():
        if any(r["case"]["dataset"] == ds and r["role"] == "measure" for r in rep["cases"]):
            lines += [f"## {title}", "", results_table(rep["cases"], ds), ""]
    if any(r["role"] == "cpu ceiling" for r in rep["cases"]):
        lines += ["## CPU ceiling: croupier unordered on page-cache files", "", ceilings_table(rep["cases"]), ""]
        lines += ["## Where the CPU goes, case by case", "",
                  "CPU seconds per 1,000 samples delivered, over the whole case: croupier's server by thread (read "
                  "threads: the native pool's blocking preads, or obstore's Tokio threads), the trainers with their "
                  "workers, and the storage's own process (the FUSE daemon, the S3 server), which runs on the same "
                  f"{cores} cores. *Cores busy*: that CPU per sample at the steady rate (above the machine's cores "
                  "where the case's start, whose CPU is counted, cost more per sample than its steady state). "
                  "*Cores it would take*: the same CPU per sample at 70% of the case's ceiling.", "", cpu_budget_table(rep["cases"]), ""]
    if rep.get("profile"):
        measured = next((r for r in rep["cases"] if r["role"] == "measure" and r["case"]["dataset"] == "text"
                         and r["condition"]["key"] == "fuse" and not r["condition"].get("evict_every_s")
                         and r["label"] == "croupier unordered"), None)
        lines += ["## Where croupier's time goes", ""] + profile_section(rep["profile"], measured)
    if rep.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in rep["notes"]] + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots] + [""]
    if rep.get("errors"):
        lines += ["## Failures and warnings", ""] + [f"- {e}" for e in rep["errors"]] + [""]
    return "\n".join(lines)


def plots(rep: dict[str, Any], out: Path, stem: str) -> list[str]:
    """real-throughput.png: samples/s per system, per dataset and storage (log); real-amplification.png:
    storage reads and KB per delivered sample (log)."""
    from .plots import pyplot, save

    cases = [r for r in rep.get("cases", []) if r["role"] == "measure"]
    datasets = [d for d in DATASET_TITLES if any(r["case"]["dataset"] == d for r in cases)]
    if not datasets:
        return []
    plt = pyplot()
    made = []
    for name, rows_spec in (
        ("throughput", [("samples/s (log)", lambda r: r["samples_per_s"])]),
        ("amplification", [("storage reads per sample (log)", lambda r: r["storage"].get("reads_per_sample")),
                           ("storage KB per sample (log)", lambda r: (r["storage"].get("bytes_per_sample") or 0) / 1024)]),
    ):
        fig, axes = plt.subplots(len(rows_spec), len(datasets), figsize=(6 * len(datasets), 4.8 * len(rows_spec) + 1.5),
                                 squeeze=False)
        for col, ds in enumerate(datasets):
            rows = [r for r in cases if r["case"]["dataset"] == ds]
            conds = list(dict.fromkeys(r["condition"]["name"] for r in rows))
            systems = list(dict.fromkeys(r["label"] for r in rows))
            width = 0.8 / max(len(systems), 1)
            for row, (ylabel, value) in enumerate(rows_spec):
                ax = axes[row][col]
                for i, system in enumerate(systems):
                    xs, ys = [], []
                    for j, c in enumerate(conds):
                        r = next((r for r in rows if r["condition"]["name"] == c and r["label"] == system), None)
                        v = value(r) if r is not None else None
                        if v:
                            xs.append(j + i * width)
                            ys.append(max(v, 1e-3))
                    ax.bar(xs, ys, width, label=system)
                ax.set_xticks([j + 0.4 - width / 2 for j in range(len(conds))],
                              [textwrap.fill(c, 18) for c in conds], fontsize=8)
                ax.set_yscale("log")
                ax.set_ylabel(ylabel)
                if row == 0:
                    ax.set_title(DATASET_TITLES[ds], fontsize=9)
            handles, labels = axes[0][col].get_legend_handles_labels()
            axes[-1][col].legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
        fig.suptitle(f"croupier bench ({rep['suite']}): real slow storage, {rep['world']} ranks, batch {rep['batch']}")
        made.append(str(save(fig, out / f"{stem}-{name}.png")))
    return made


def main(argv: list[str] | None = None) -> int:
    import json
    import sys

    argv = sys.argv[1:] if argv is None else argv
    for name in argv:
        path = Path(name)
        rep = json.loads(path.read_text())
        made = plots(rep, path.parent, rep["suite"])
        path.with_suffix(".md").write_text(markdown(rep, made))
        print(f"wrote {path.with_suffix('.md')} and {len(made)} plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
