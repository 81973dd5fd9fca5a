"""Turn a suite's measurements into the committed JSON and Markdown, and check the targets."""

from __future__ import annotations

import math
import os
from typing import Any

from .reporting import header_lines, num, target

DATASET_TITLES = {
    "text": "text rows (Hugging Face save_to_disk, Arrow)",
    "imagefolder": "images, ImageFolder (one JPEG file per sample)",
    "shards": "images, WebDataset tar shards (same JPEGs)",
}


def derive(case: dict[str, Any], decode_rates: dict[str, float], cores: int) -> dict[str, Any]:
    """Add the ceilings known from the case alone: C/L with injected latency, and the decode rate."""
    c = case["case"]
    latency_ms = c["storage"]["latency_ms"]
    mean_l = latency_ms / 1000 * math.exp(0.5**2 / 2)
    io = case["reads_in_flight"] / mean_l if latency_ms else None
    return {**case, "ceiling_c_over_l": io, "ceiling_decode": decode_rates.get(c["dataset"], math.inf) * cores}


def _key(r: dict[str, Any]) -> tuple[str, str]:
    return r["case"]["dataset"], r["case"]["storage"]["name"]


def _cpu_ceiling(r: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The same system's rate with nothing to wait for: croupier's unordered path with 0 ms
    injected (the better of its runs: suites measure it at the start and at the end, as
    other jobs on a shared machine can take CPU from one of them), else the page-cache case."""
    label, ds = r["case"]["system"]["label"], r["case"]["dataset"]
    for storage in ("0 ms injected (no wait)", "page cache"):
        runs = [other for other in results
                if (other["case"]["dataset"], other["case"]["storage"]["name"], other["case"]["system"]["label"])
                == (ds, storage, label)]
        if runs:
            return max(runs, key=lambda other: other["samples_per_s"])
    return None


def finish(results: list[dict[str, Any]]) -> None:
    """Ceilings that need the other cases, fractions of the ceiling, and each throughput as a
    multiple of the best DataLoader (or WebDataset) at the same dataset and storage."""
    for r in results:
        cpu = _cpu_ceiling(r, results) if r["case"]["storage"]["latency_ms"] else None
        bounds = {"C/L": r["ceiling_c_over_l"], "decode": r["ceiling_decode"],
                  "CPU": cpu["samples_per_s"] if cpu is not None else None}
        bounds = {k: v for k, v in bounds.items() if v}
        binding = min(bounds, key=bounds.get)
        r["ceiling_cpu"] = bounds.get("CPU")
        r["ceiling"], r["ceiling_binding"] = bounds[binding], binding
        r["fraction_of_ceiling"] = r["samples_per_s"] / bounds[binding]
    best: dict[tuple[str, str], float] = {}
    for r in results:
        if r["case"]["system"]["kind"] in ("dataloader", "webdataset"):
            best[_key(r)] = max(best.get(_key(r), 0.0), r["samples_per_s"])
    for r in results:
        b = best.get(_key(r))
        r["vs_best_baseline"] = r["samples_per_s"] / b if b else None


def _find(results: list[dict[str, Any]], dataset: str, storage: str, label: str) -> dict[str, Any] | None:
    for r in results:
        if _key(r) == (dataset, storage) and r["case"]["system"]["label"] == label:
            return r
    return None


def _best_dl(results: list[dict[str, Any]], dataset: str, storage: str) -> dict[str, Any] | None:
    dls = [r for r in results if _key(r) == (dataset, storage) and r["case"]["system"]["kind"] == "dataloader"]
    return max(dls, key=lambda r: r["samples_per_s"]) if dls else None


def check_targets(kind: str, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    datasets = ("text",) if kind == "first" else ("text", "imagefolder")
    latencies = ("5 ms lognormal",) if kind == "first" else ("5 ms lognormal", "20 ms lognormal")
    for ds in datasets:
        for st in latencies:
            cr = _find(results, ds, st, "croupier unordered")
            dl = _best_dl(results, ds, st)
            if cr is None or dl is None:
                continue
            dl_name = dl["case"]["system"]["label"]
            out.append(target(f"{ds}, {st}: unordered >= 10x best DataLoader", cr["samples_per_s"] / dl["samples_per_s"],
                              10.0, f"{cr['samples_per_s']:,.0f} vs {dl['samples_per_s']:,.0f} samples/s ({dl_name}); "
                                    f"CPU s/1k {cr['cpu_s_per_1k']:.3f} vs {dl['cpu_s_per_1k']:.3f}"))
            if kind == "first":
                io = cr["ceiling_c_over_l"]
                out.append(target(f"{ds}, {st}: unordered >= 0.5 of C/L", cr["samples_per_s"] / io, 0.5,
                                  f"{cr['samples_per_s']:,.0f} of C/L = {cr['reads_in_flight']} / "
                                  f"{cr['case']['storage']['latency_ms'] * math.exp(0.125):.2f} ms = {io:,.0f}"))
            else:
                out.append(target(f"{ds}, {st}: unordered >= 0.7 of ceiling", cr["fraction_of_ceiling"], 0.7,
                                  f"{cr['samples_per_s']:,.0f} of {cr['ceiling']:,.0f} samples/s ({cr['ceiling_binding']}"
                                  f"; C/L {cr['ceiling_c_over_l']:,.0f}, decode {cr['ceiling_decode']:,.0f}, "
                                  f"CPU {num(cr['ceiling_cpu'])})"))
        cr = _find(results, ds, "page cache", "croupier unordered")
        dl = _best_dl(results, ds, "page cache")
        if cr is not None and dl is not None:
            out.append(target(f"{ds}, page cache: unordered not slower than best DataLoader",
                              cr["samples_per_s"] / dl["samples_per_s"], 1.0,
                              f"{cr['samples_per_s']:,.0f} vs {dl['samples_per_s']:,.0f} samples/s "
                              f"({dl['case']['system']['label']})"))
    return out


def results_table(results: list[dict[str, Any]], dataset: str) -> str:
    head = ("| storage | system | shuffle | samples/s | MB/s | first batch s | batch p50 ms | batch p99 ms "
            "| CPU s/1k samples (server) | peak RSS MB server / trainer (+workers) | C | C/L | decode ceiling "
            "| CPU ceiling | of ceiling (bound) | vs best baseline |\n" + "|---" * 16 + "|")
    lines = [head]
    for r in results:
        c = r["case"]
        if c["dataset"] != dataset:
            continue
        if r.get("error"):
            lines.append(f"| {c['storage']['name']} | {c['system']['label']} | {c['system']['shuffle']} | "
                         f"failed: {r['error'][:80]} |" + " |" * 12)
            continue
        server_cpu = f" ({r['server_cpu_s_per_1k']:.3f})" if r["server_cpu_s_per_1k"] is not None else ""
        server_rss = num(r["server_peak_rss_mb"])
        workers = f" (+{r['workers_private_rss_mb']:,.0f})" if r["workers_private_rss_mb"] else ""
        lines.append(
            f"| {c['storage']['name']} | {c['system']['label']} | {c['system']['shuffle']} "
            f"| {num(r['samples_per_s'])} | {num(r['mb_per_s'], '.1f')} | {num(r['first_batch_s'], '.2f')} "
            f"| {num(r['batch_p50_ms'], '.1f')} | {num(r['batch_p99_ms'], '.1f')} "
            f"| {r['cpu_s_per_1k']:.3f}{server_cpu} | {server_rss} / {r['trainer_peak_rss_mb']:,.0f}{workers} "
            f"| {r['reads_in_flight']} | {num(r['ceiling_c_over_l'])} | {num(r['ceiling_decode'])} "
            f"| {num(r['ceiling_cpu'])} | {num(100 * r['fraction_of_ceiling'], '.0f')}% ({r['ceiling_binding']}) "
            f"| {num(r['vs_best_baseline'], '.2f')}{'x' if r['vs_best_baseline'] else ''} |"
        )
    return "\n".join(lines)


def targets_table(targets: list[dict[str, Any]]) -> str:
    lines = ["| target | measured | met | detail |", "|---|---|---|---|"]
    for t in targets:
        lines.append(f"| {t['target']} | {num(t['measured'], '.2f')} | {'yes' if t['met'] else '**no**'} | {t['detail']} |")
    return "\n".join(lines)


#: Per curve: (column title, field, format) of its table.
CURVE_COLUMNS: dict[str, list[tuple[str, str, str]]] = {
    "reads_in_flight": [("reads in flight C", "reads_in_flight", "d"), ("samples/s", "samples_per_s", ",.0f"),
                        ("C/L", "ceiling_c_over_l", ",.0f"), ("of C/L", "fraction", ".0%"),
                        ("server CPU s/1k", "server_cpu_s_per_1k", ".3f")],
    "streams": [("streams", "streams", "d"), ("samples/s", "samples_per_s", ",.0f"), ("MB/s", "mb_per_s", ".1f"),
                ("streams/s", "streams_per_s", ".1f"), ("batch p50 ms", "batch_p50_ms", ".1f"),
                ("batch p99 ms", "batch_p99_ms", ".1f"), ("server CPU s/1k", "server_cpu_s_per_1k", ".3f"),
                ("errors", "errors", "d")],
    "planner": [("rows", "rows", ".0e"), ("first batch ms", "first_batch_ms", ".2f"),
                ("indices/s", "indices_per_s", ",.0f"), ("plan peak MB", "plan_peak_mb", ".2f"),
                ("numpy permutation s", "numpy_permutation_s", ".3f"), ("numpy peak MB", "numpy_peak_mb", ",.0f")],
}


def curve_tables(curves: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for name, columns in CURVE_COLUMNS.items():
        if not curves.get(name):
            continue
        out += ["| " + " | ".join(title for title, _, _ in columns) + " |", "|---" * len(columns) + "|"]
        out += ["| " + " | ".join(num(p[key], fmt) for _, key, fmt in columns) + " |" for p in curves[name]]
        out.append("")
    return out


def markdown(report: dict[str, Any], plots: list[str]) -> str:
    cores = report["machine"]["cores"]
    spec = report["data"]
    lines = [
        f"# croupier bench: suite `{report['suite']}`",
        "",
        *header_lines(report),
        f"Data: {spec['text_rows']:,} text rows ({spec['text_words']} words, {spec['tokens']} int32 tokens each) "
        f"written by `datasets` save_to_disk; {spec['images']:,} {spec['image_size']}x{spec['image_size']} RGB JPEGs "
        f"as an ImageFolder tree and as tar shards of {spec['shard_size']:,}. Batch {report['batch']}, "
        f"{report['world']} trainer ranks (one process each, run side by side), seed 0.",
        "",
        "Storage: *page cache*: files read once before the case; *N ms lognormal*: the same, plus a read latency "
        "drawn per sample read from a lognormal with median N ms and sigma 0.5 (mean 1.133 N ms): `croupier serve "
        "--latency-ms N` for croupier (which wakes at the nearest millisecond, so reads due together share a wake-up), a Dataset wrapper sleeping a draw of the same seeded distribution before each "
        "`__getitem__` (or each WebDataset sample) for the others; *cold disk*: every file dropped from the page cache "
        "(fsync + posix_fadvise DONTNEED) before the case.",
        "",
        "Figures: samples/s and MB/s are steady-state, at the trainer: each rank's batches after its warm-up "
        "ones (those that can pile up while the first is awaited: croupier's read-ahead window plus the Loader's "
        "4-batch buffer; 2 per DataLoader worker; 2 for croupier ordered and 0 workers; or the first 10% if more) "
        "over the time they took, summed over ranks; each rank runs until it has three times as many batches past its warm-up "
        "as in it (plus 4) and the case's seconds since its first batch (15 s at most); MB are those of the collated batch (tensors and strings). First batch: from building the "
        "loader (modules already imported) to the first batch. Batch p50/p99: intervals between batches at a rank. "
        "CPU s/1k samples: all CPU of the trainer processes, their workers and the server, per 1,000 samples "
        "(server alone in brackets). C: reads in flight over all ranks; C/L its ceiling with mean latency L; "
        f"decode ceiling: one core's measured decode rate, the better of a measurement at the start and one at the end "
        f"({', '.join(f'{k} {v:,.0f}/s' for k, v in report['decode_rates'].items())}) "
        f"times {cores} cores; CPU ceiling (cases with injected latency): the same system with nothing to wait "
        "for on this machine (croupier: its unordered path with 0 ms injected, the better of a run at the start "
        "and one at the end; others: their page-cache case); "
        "of ceiling: samples/s over the smallest of the three, which is named. "
        "Peak RSS: VmHWM of the server and of the largest trainer rank; workers: their private (anonymous) "
        "memory at the end, summed.",
        "",
    ]
    if report.get("targets"):
        lines += ["## Targets", "", targets_table(report["targets"]), ""]
    for ds in DATASET_TITLES:
        if any(r["case"]["dataset"] == ds for r in report["cases"]):
            lines += [f"## {DATASET_TITLES[ds]}", "", results_table(report["cases"], ds), ""]
    if report.get("curves"):
        lines += ["## Curves", ""]
        c = report["curves"]
        if c.get("reads_in_flight"):
            lines.append(f"Throughput against reads in flight: croupier unordered, 1 rank, text, "
                         f"{c['in_flight_latency_ms']:g} ms lognormal; `--max-reads-per-stream C`, read-ahead of 4C samples "
                         f"(prefetch 4C/64 batches, at most 256).\n")
        if c.get("streams"):
            lines.append(f"Throughput against concurrent streams: `croupier loadtest` with N workers on N "
                         f"connections, rank i of N, up to 20 batches of 64 per stream (fewer where a rank has fewer), {c['streams_latency_ms']:g} ms "
                         "lognormal, one server; the load generator is one Python process on the same machine.\n")
        if c.get("planner"):
            lines.append("Planner: `EpochPlan` time to the first batch of the last rank (world 8), indices/s "
                         "dealing a million indices, and peak traced memory; numpy's `permutation` for comparison.\n")
        lines += curve_tables(c)
    if report.get("shuffle_quality"):
        lines += ["## Shuffle quality", "", report["shuffle_quality"]["markdown"], ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({os.path.basename(p)})" for p in plots] + [""]
    if report.get("errors"):
        lines += ["## Failures and warnings", ""] + [f"- {e}" for e in report["errors"]] + [""]
    return "\n".join(lines)
