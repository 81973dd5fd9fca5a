"""PNG plots of a suite's report (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import DATASET_TITLES


def pyplot():
    """matplotlib's pyplot on the Agg backend (files, no display); ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> Path:
    """`fig` laid out, written to `path` at the reports' resolution, and closed."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def throughput(report: dict[str, Any], path: Path) -> Path | None:
    """Samples/s (log) and fraction of the ceiling, per dataset: storage on x, one bar per system."""
    datasets = [d for d in DATASET_TITLES if any(r["case"]["dataset"] == d for r in report["cases"])]
    if not datasets:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(2, len(datasets), figsize=(6 * len(datasets), 9.5), squeeze=False)
    for col, ds in enumerate(datasets):
        rows = [r for r in report["cases"] if r["case"]["dataset"] == ds and not r.get("error")]
        storages = list(dict.fromkeys(r["case"]["storage"]["name"] for r in rows))
        systems = list(dict.fromkeys(r["case"]["system"]["label"] for r in rows))
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            xs, ys, fs = [], [], []
            for j, st in enumerate(storages):
                r = next((r for r in rows if r["case"]["storage"]["name"] == st
                          and r["case"]["system"]["label"] == system), None)
                if r is not None:
                    xs.append(j + i * width)
                    ys.append(max(r["samples_per_s"], 1e-3))
                    fs.append(r["fraction_of_ceiling"] or 0)
            axes[0][col].bar(xs, ys, width, label=system)
            axes[1][col].bar(xs, fs, width, label=system)
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(storages))], storages, rotation=20, fontsize=8)
        axes[0][col].set_yscale("log")
        axes[0][col].set_title(DATASET_TITLES[ds], fontsize=9)
        axes[0][col].set_ylabel("samples/s (log)")
        axes[1][col].set_ylabel("fraction of ceiling")
        axes[1][col].set_ylim(0, 1.1)
        handles, labels = axes[0][col].get_legend_handles_labels()
        axes[1][col].legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=1)
    fig.suptitle(f"croupier bench ({report['suite']}): {report['world']} ranks, batch {report['batch']}")
    return save(fig, path)


def in_flight(points: list[dict[str, Any]], latency_ms: float, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    c = [p["reads_in_flight"] for p in points]
    ax.plot(c, [p["samples_per_s"] for p in points], "o-", label="croupier unordered (measured)")
    ax.plot(c, [p["ceiling_c_over_l"] for p in points], "--", label="ceiling C/L")
    ax.set(xscale="log", yscale="log", xlabel="reads in flight C", ylabel="samples/s",
           title=f"Throughput vs reads in flight ({latency_ms:g} ms lognormal, 1 rank)")
    ax.legend()
    return save(fig, path)


def streams(points: list[dict[str, Any]], latency_ms: float, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    n = [p["streams"] for p in points]
    ax.plot(n, [p["samples_per_s"] for p in points], "o-", label="samples/s (all streams)")
    ax.set(xscale="log", xlabel="concurrent trainer streams", ylabel="samples/s",
           title=f"One server, N streams ({latency_ms:g} ms lognormal)")
    ax2 = ax.twinx()
    ax2.plot(n, [p["batch_p99_ms"] for p in points], "s--", color="tab:red", label="batch p99 ms")
    ax2.set_ylabel("batch p99 ms")
    fig.legend(loc="upper left", fontsize=8)
    return save(fig, path)


def planner(points: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    rows = [p["rows"] for p in points]
    a.plot(rows, [p["first_batch_ms"] / 1000 for p in points], "o-", label="EpochPlan: first batch")
    np_points = [p for p in points if p["numpy_permutation_s"] is not None]
    a.plot([p["rows"] for p in np_points], [p["numpy_permutation_s"] for p in np_points], "s--",
           label="numpy permutation")
    a.set(xscale="log", yscale="log", xlabel="dataset rows", ylabel="seconds", title="Time to plan")
    a.legend()
    b.plot(rows, [p["plan_peak_mb"] for p in points], "o-", label="EpochPlan (dealing 1M indices)")
    b.plot([p["rows"] for p in np_points], [p["numpy_peak_mb"] for p in np_points], "s--", label="numpy permutation")
    b.set(xscale="log", yscale="log", xlabel="dataset rows", ylabel="peak MB", title="Planner memory")
    b.legend()
    return save(fig, path)


def all_plots(report: dict[str, Any], out: Path, stem: str) -> list[str]:
    made = []
    p = throughput(report, out / f"{stem}-throughput.png")
    if p:
        made.append(str(p))
    c = report.get("curves") or {}
    if c.get("reads_in_flight"):
        made.append(str(in_flight(c["reads_in_flight"], c["in_flight_latency_ms"], out / f"{stem}-in-flight.png")))
    if c.get("streams"):
        made.append(str(streams(c["streams"], c["streams_latency_ms"], out / f"{stem}-streams.png")))
    if c.get("planner"):
        made.append(str(planner(c["planner"], out / f"{stem}-planner.png")))
    return made
