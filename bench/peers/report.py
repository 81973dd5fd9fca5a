"""peers.md and its plots from the suite's JSON (suite.run_peers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..reporting import header_lines, num

#: What a resume cell says for a system that has no resume case (suite.VARIANTS gives it none).
NO_RESUME = {"tfdata": "none: a tf.data service iterator cannot be checkpointed",
             "lance": "none: Lance has no loader state (a take loop keeps its own position)",
             "dataloader-rs": "none: PyDataloader has no state_dict"}
#: The suites run at the issues' sizes (any other name is a smoke run on other data).
ISSUE_RUNS = ("peers", "peers-cache", "peers-cache-kernel", "peers-cache-raised", "peers-cache-s3", "peers-cache-rclone",
              "peers-cache-s3fs", "peers-cache-mounts", "peers-mounts")
VARIANT_NAMES = {"default": "default", "strongest": "strongest shuffle", "cache10": "cache = 10% of data",
                 "loader": "its torch loader", "shards": "images as WebDataset tar shards"}


def _rejected_by(q: dict) -> str:
    """The uniformity tests that rejected the order, with their p-values and the threshold."""
    from croupier.shuffle_quality import bonferroni_level, rejecting

    pv = q.get("pvalues") or {}
    if not pv:
        return "no p-values recorded"
    failed = sorted((v, k) for k, v in rejecting(pv).items())
    tests = ", ".join(f"{k} p = {v:.3g}" for v, k in failed) or "none"
    return f"rejected by {tests}, against a Bonferroni level of {bonferroni_level(pv):.3g}"


def _rate(r: dict[str, Any], epoch: int) -> float | None:
    """The epoch's rate; a cut epoch's (a thrashing cache: see PeersSuite.cache10_epoch_s) counts too."""
    eps = r.get("epochs") or []
    if epoch < len(eps) and (eps[epoch]["complete"] or eps[epoch].get("cut")):
        return eps[epoch]["samples_per_s"]
    return None


def _rate_cell(r: dict[str, Any], epoch: int) -> str:
    eps = r.get("epochs") or []
    cut = epoch < len(eps) and eps[epoch].get("cut")
    if epoch < len(eps) and not eps[epoch]["complete"] and not cut and eps[epoch]["samples"] == 0:
        return "not run" if epoch and eps[epoch - 1].get("cut") else "-"
    return num(_rate(r, epoch)) + (" (cut)" if cut else "")


def one_line(r: dict[str, Any]) -> str:
    if r["variant"] == "resume":
        rs = r.get("resume")
        return (f"resume after {r.get('kill_after_batches_per_rank')} batches/rank: "
                + (f"lost {rs['lost']}, repeated {rs['repeated']} of {rs['expected']}" if rs else "not checked")
                + (f"; problems: {r['problems']}" if r["problems"] else "") + f" ({r['wall_s']:.1f} s)")
    q = r.get("quality") or {}
    return (f"epoch 1 {_rate_cell(r, 0)} samples/s, epoch 2 {_rate_cell(r, 1)}, first batch {num(r.get('first_batch_s'), '.2f')} s, "
            f"disk {num(r.get('peak_local_disk_mb'), '.1f')} MB, RSS {num(r.get('peak_rss_mb'))} MB, "
            f"displacement {num(q.get('mean_displacement'), '.3f')}, uniform {q.get('uniform', '-')}"
            + (f"; problems: {r['problems']}" if r["problems"] else "") + f" ({r['wall_s']:.1f} s)")


def _resume_cell(rep: dict[str, Any], r: dict[str, Any]) -> str:
    m = next((x for x in rep["cases"] if x["variant"] == "resume" and x["system"] == r["system"]
              and x["dataset"] == r["dataset"] and x["condition"]["name"] == r["condition"]["name"]), None)
    if m is None or not m.get("resume"):
        return NO_RESUME.get(r["system"], "-")
    rs = m["resume"]
    return f"{'exact' if rs['exact'] else 'NOT exact'}: lost {rs['lost']}, repeated {rs['repeated']}"


def setting(r: dict[str, Any]) -> str:
    """The row's variant, with its cache budget where it has one a reader needs to see."""
    name = VARIANT_NAMES.get(r["variant"], r["variant"])  # "resume" rows are in the server-cache table too
    if r["variant"] == "cache10" and r.get("cache_limit_bytes"):
        return f"{name} ({r['cache_limit_bytes'] / 1e6:.1f} of {r['dataset_bytes_on_storage'] / 1e6:.1f} MB)"
    if r["system"] == "croupier" and r["variant"] in ("default", "shards") and "server_cache" in r:
        return f"{name} (server cache: its default, 25% of RAM)"
    return name


def server_cache_lines(rep: dict[str, Any]) -> list[str]:
    """croupier's server cache counters per row (scraped from its /metrics before it stopped)."""
    rows = [r for r in rep["cases"] if r.get("server_cache")]
    if not rows:
        return []
    out = ["| storage | dataset | setting | hit ratio | storage bytes per delivered sample | filled MB | evictions "
           "| resident MB | MB the storage daemon served (all epochs) |", "|---" * 9 + "|"]
    for r in rows:
        c = r["server_cache"]
        mb = (lambda k: num(c[k] / 1e6, '.1f') if k in c else "-")
        served = (r.get("storage") or {}).get("bytes")
        out.append(f"| {r['condition']['name']} | {r['dataset']} | {setting(r)} "
                   f"| {num(c.get('croupier_cache_hit_ratio'), '.3f')} "
                   f"| {num(c.get('croupier_cache_storage_bytes_per_sample'), '.0f')} | {mb('croupier_cache_fill_bytes')} "
                   f"| {num(c.get('croupier_cache_evictions'), '.0f')} | {mb('croupier_cache_resident_bytes')} "
                   f"| {num(served / 1e6 if served is not None else None, '.1f')} |")
    return ["## croupier's server cache, per row (its /metrics at the end of the run: both epochs)", "",
            "The last column counts what reached the latency FS's daemon: a read the kernel's page cache answers "
            "(a FUSE mount keeps the pages of a file while it stays open) never reaches it, and no system's page "
            "cache is limited here.", "", *out, ""]


def table(rep: dict[str, Any], cond: str, ds: str) -> str:
    rows = [r for r in rep["cases"] if r["condition"]["name"] == cond and r["dataset"] == ds and r["variant"] != "resume"]
    if not rows:
        return ""
    ref = rep.get("uniform_reference", {}).get(ds, {})
    head = ("| system | setting | shuffle | epoch 1 (cold) samples/s | epoch 2 samples/s | first batch s "
            "| peak local disk MB | peak RSS MB | mean displacement | Spearman | shards per batch "
            "| Mosaic entropy (harmonic) | uniform? | mid-epoch resume |\n" + "|---" * 14 + "|")
    lines = [head]
    for r in rows:
        q = r.get("quality") or {}
        me = (q.get("mosaic_entropy") or {}).get("harmonic")
        lines.append(
            f"| {r['label']} | {setting(r)} | {r['shuffle']} | {_rate_cell(r, 0)} | {_rate_cell(r, 1)} "
            f"| {num(r.get('first_batch_s'), '.2f')} | {num(r.get('peak_local_disk_mb'), '.1f')} | {num(r.get('peak_rss_mb'))} "
            f"| {num(q.get('mean_displacement'), '.3f')} | {num(q.get('spearman'), '+.3f')} | {num(q.get('shards_per_batch'), '.1f')} "
            f"| {num(me, '.2f')} | {'yes' if q.get('uniform') else ('no' if q else '-')} "
            f"| {_resume_cell(rep, r) if r['variant'] == 'default' else ''} |")
    if ref:
        lines.append(
            f"| *numpy uniform permutation* | reference | | | | | | | {num(ref['mean_displacement'], '.3f')} "
            f"| {num(ref['spearman'], '+.3f')} | {num(ref['shards_per_batch'], '.1f')} "
            f"| {num(ref['mosaic_entropy']['harmonic'], '.2f')} | {'yes' if ref['uniform'] else 'no'} | |")
    return "\n".join(lines)


def plots(rep: dict[str, Any], out: Path, name: str) -> list[str]:
    """`<name>-throughput.png` (epoch rates per storage and dataset) and `<name>-quality.png`
    (epoch 1's rate against the delivered order's mean displacement): their file names."""
    from ..plots import pyplot, save

    try:
        plt = pyplot()
    except ImportError:
        return []
    made: list[str] = []
    panels = sorted({(r["condition"]["name"], r["dataset"]) for r in rep["cases"] if r["variant"] != "resume"})
    if panels:
        cols = min(2, len(panels))
        nrows = -(-len(panels) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(7 * cols, 5 * nrows), squeeze=False)
        for ax in axes.flat[len(panels):]:
            ax.axis("off")
        for ax, (cond, ds) in zip(axes.flat, panels):
            rows = [r for r in rep["cases"] if r["condition"]["name"] == cond and r["dataset"] == ds
                    and r["variant"] != "resume"]
            labels = [f"{r['label']}\n{VARIANT_NAMES[r['variant']]}" for r in rows]
            x = range(len(rows))
            ax.bar([i - 0.2 for i in x], [_rate(r, 0) or 0 for r in rows], 0.4, label="epoch 1 (cold)")
            ax.bar([i + 0.2 for i in x], [_rate(r, 1) or 0 for r in rows], 0.4, label="epoch 2")
            ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{ds}, {cond}", fontsize=9)
            ax.set_ylabel("samples/s at the trainer (all ranks)")
            ax.legend(fontsize=7)
        made.append(save(fig, out / f"{name}-throughput.png").name)
    pts = [r for r in rep["cases"] if r.get("quality") and _rate(r, 0)]
    if pts:
        fig, ax = plt.subplots(figsize=(7, 5))
        for r in pts:
            ax.scatter(r["quality"]["mean_displacement"], _rate(r, 0), s=30)
            ax.annotate(f"{r['label']} {VARIANT_NAMES[r['variant']]}, {r['dataset']}, {r['condition']['key']}",
                        (r["quality"]["mean_displacement"], _rate(r, 0)), fontsize=6)
        ax.axvline(1 / 3, color="grey", linestyle=":", label="uniform shuffle (1/3)")
        ax.set_xlabel("mean displacement of the delivered order (|position - id| / n)")
        ax.set_ylabel("epoch 1 (cold) samples/s")
        ax.set_title("throughput against shuffle quality")
        ax.legend(fontsize=7)
        made.append(save(fig, out / f"{name}-quality.png").name)
    return made


def markdown(rep: dict[str, Any], made: list[str]) -> str:
    d = rep["data"]
    out = [f"# croupier beside Mosaic Streaming, LitData, tf.data service, torchdata, Lance, dataloader-rs, Grain "
           f"(`{rep['suite']}`)", ""]
    if rep["suite"] not in ISSUE_RUNS:  # the quick run, or the matrix on other (tiny) sizes
        out += [f"**Smoke figures on tiny data (`{rep['suite']}`), not the issue's results:** "
                f"{d['text_rows']:,} text rows and {d['images']:,} images, on a shared, busy machine; they show that "
                "the harness runs end to end, not how the systems compare (start-up dominates epochs this short).", ""]
    out += [*header_lines(rep),
            f"Data: text {d['text_rows']:,} rows (~1 KB each), images {d['images']:,} JPEGs of "
            f"{d['image_size']}x{d['image_size']}; each peer's shards written by its own writer in "
            f"{rep['shards']} shards per dataset. {rep['world']} ranks, batch {rep['batch']}, "
            f"{rep['workers']} DataLoader worker(s) per rank for the peers that have them, {rep['epochs']} epochs "
            f"from a fresh local cache (epoch 1 is cold: storage evicted, cache empty).", "",
            "Versions (pip freeze of each venv's key packages):", ""]
    for sys_, v in rep["versions"].items():
        out.append(f"- {sys_}: " + ", ".join(f"{k} {x}" for k, x in v.items()))
    out += ["", "How to read: samples/s are all ranks' samples of the epoch over its wall time, from the "
            "first rank starting it to the last batch of any rank (epoch 1 includes building the loader and "
            "the first downloads). The ranks meet at each epoch's end, as a synchronous trainer's do (at every "
            "step's all-reduce): a later epoch's clock starts once the last rank has ended the one before. Peak local disk is the cache folder polled every 0.1 s; peak RSS sums every "
            "process of the system on the trainer machine (ranks, their workers, croupier's server). "
            "Shuffle figures are on epoch 1's delivered order, ranks interleaved batch by batch: mean displacement "
            "(1/3 for a uniform shuffle), Spearman (0), distinct shards per batch, Mosaic's neighbour-difference "
            "entropy (harmonic mean of sample and shard entropies; compare with the numpy row), and whether "
            "the uniformity tests of croupier.shuffle_quality reject it. Resume: the trainer killed after a third "
            "of epoch 1 right after its checkpoint, resumed from it; ids lost and repeated against the "
            "uninterrupted epoch.", ""]
    conds = list(dict.fromkeys(r["condition"]["name"] for r in rep["cases"]))
    for cond in conds:
        for ds in ("text", "image"):
            t = table(rep, cond, ds)
            if t:
                out += [f"## {ds}, {cond}", "", t, ""]
    out += server_cache_lines(rep)
    for f in made:
        out += [f"![{f}]({f})", ""]
    gt = goal_table(rep.get("goal") or [])
    if gt:
        out += ["## The goal: croupier's throughput against the peers'", "",
                "Epoch rates; 'uniform peers' are the peer rows whose delivered order passed the uniformity tests "
                "(equal shuffle quality), 'any peer' the fastest row whatever its quality, 'Lance' Lance's "
                "fastest row (its take of a global permutation, or its torch loader), 'Mosaic's cold epoch' Mosaic's "
                "default epoch 1, 'every peer's best epoch' the fastest epoch of any peer row whose cache holds the "
                "data, '10% cache' croupier's server with `--cache-memory` at 10% of the data's bytes against the "
                "peers with theirs limited the same (target: 3x).", "", gt, ""]
    out += ["## Reading", "", reading(rep), ""]
    notes = sorted({f"{r['label']}: {n}" for r in rep["cases"] for n in r.get("notes", [])})
    if notes:
        out += ["## Set-up notes from the runners", ""] + [f"- {n}" for n in notes] + [""]
    if rep["skipped"]:
        out += ["## Skipped", ""] + [f"- {s}" for s in rep["skipped"]] + [""]
    if rep["errors"]:
        out += ["## Errors and problems", ""] + [f"- {e}" for e in rep["errors"]] + [""]
    return "\n".join(out)


# ---- the goal, and a reading generated from the figures -------------------------------------------

def _rows(rep: dict[str, Any], cond: str, ds: str) -> list[dict[str, Any]]:
    return [r for r in rep["cases"] if r["condition"]["name"] == cond and r["dataset"] == ds and r["variant"] != "resume"]


def goal(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """The issues' goals as numbers, per storage and dataset. Per epoch, croupier's default row against
    every peer row whose delivered order passed the uniformity tests (equal quality), the best peer
    row whatever its quality, and Lance's best row (issue 21). Issue 25's targets: epoch 1 at least
    Mosaic's cold epoch, every later epoch at least every peer's best epoch (data that fits), and with
    the cache at 10% of the data, croupier's cache10 row at least 3x the peers' cache10 rows."""
    out = []
    for cond in dict.fromkeys(r["condition"]["name"] for r in rep["cases"]):
        for ds in ("text", "image"):
            rows = _rows(rep, cond, ds)
            mine = {v: next((r for r in rows if r["system"] == "croupier" and r["variant"] == v), None)
                    for v in ("default", "cache10", "shards")}
            for epoch in (0, 1):
                out += _epoch_goals(cond, ds, epoch, mine, [r for r in rows if r["system"] != "croupier"])
    return out


def _epoch_goals(cond: str, ds: str, epoch: int, mine: dict[str, Any], peer_rows: list[dict[str, Any]]) -> list[dict]:
    """One epoch's comparisons: (what against, croupier's row, the peer rows, the ratio to reach)."""
    peers = [r for r in peer_rows if _rate(r, epoch)]
    fits = [r for r in peers if r["variant"] != "cache10"]
    # A 10% cache against each peer's best epoch: a thrashing peer's epoch is cut and its later ones not run.
    small = [r for r in peer_rows if r["variant"] == "cache10" and any(_rate(r, e) for e in range(len(r.get("epochs") or [])))]
    groups = [("uniform peers", "default", [r for r in peers if (r.get("quality") or {}).get("uniform")], 1.0, None),
              ("any peer", "default", peers, 1.0, None),
              ("Lance", "default", [r for r in peers if r["system"] == "lance"], 1.0, None)]
    if epoch == 0:
        groups.append(("Mosaic's cold epoch", "default", [r for r in fits if r["system"] == "mosaic"
                                                          and r["variant"] == "default"], 1.0, None))
    else:  # every later epoch against every peer's best epoch, whichever epoch that was
        groups.append(("every peer's best epoch", "default", fits, 1.0, _best_epoch))
    if mine.get("shards"):  # the same comparisons for croupier's images read from tar shards
        groups += [(kind, "shards", group, target, rate_of) for kind, variant, group, target, rate_of in groups]
    groups += [("10% cache, uniform peers", "cache10", [r for r in small if _uniform(r, peer_rows)], 3.0, _best_epoch),
               ("10% cache, any peer", "cache10", small, 3.0, _best_epoch)]
    out = []
    for kind, variant, group, target, rate_of in groups:
        me = mine.get(variant)
        my_rate = _rate(me, epoch) if me else None
        if not group or my_rate is None:
            continue
        rate_of = rate_of or (lambda r: _rate(r, epoch))
        best = max(group, key=rate_of)
        out.append({"storage": cond, "dataset": ds, "epoch": epoch + 1, "against": kind, "croupier": my_rate,
                    "croupier_variant": VARIANT_NAMES[variant], "target": target,
                    "peer": f"{best['label']} ({VARIANT_NAMES[best['variant']]})", "peer_rate": rate_of(best),
                    "ratio": my_rate / rate_of(best), "met": my_rate >= target * rate_of(best),
                    "peer_uniform": _uniform(best, peer_rows),
                    "peer_disk_mb": best.get("peak_local_disk_mb")})
    return out


def _uniform(r: dict[str, Any], rows: list[dict[str, Any]]) -> bool:
    """Whether the row's order passed the uniformity tests; a cut epoch has no figures, so a cache10 row
    (the peer's default shuffle) is judged by its default row's order."""
    if r.get("quality"):
        return bool(r["quality"].get("uniform"))
    same = next((x for x in rows if x["system"] == r["system"] and x["variant"] == "default"), None)
    return r["variant"] == "cache10" and bool(same and (same.get("quality") or {}).get("uniform"))


def _best_epoch(r: dict[str, Any]) -> float:
    return max(x for x in (_rate(r, e) for e in range(len(r.get("epochs") or []))) if x is not None)


def goal_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = ["| storage | dataset | epoch | against | croupier (row) samples/s | best of them | its samples/s "
             "| croupier / it (target) | its order uniform? | its peak disk MB |", "|---" * 10 + "|"]
    for g in rows:
        target = g.get("target", 1.0)
        lines.append(f"| {g['storage']} | {g['dataset']} | {g['epoch']} | {g['against']} "
                     f"| {num(g['croupier'])} ({g.get('croupier_variant', 'default')}) | {g['peer']} "
                     f"| {num(g['peer_rate'])} | {g['ratio']:.2f}x (>= {target:g}x){'' if g['met'] else ' behind'} "
                     f"| {'yes' if g['peer_uniform'] else 'no'} | {num(g['peer_disk_mb'], '.1f')} |")
    return "\n".join(lines)


def reading(rep: dict[str, Any]) -> str:
    """Facts read off the figures (generated, so they match them), then the caveats that always hold."""
    facts = []
    g = rep.get("goal") or []
    behind = [x for x in g if not x["met"]]
    if g:
        facts.append(f"croupier's epoch rate meets its target (at least the best peer's; 3x with a 10% cache) in "
                     f"{len(g) - len(behind)} of {len(g)} comparisons of the goal table.")
    for x in behind:
        facts.append(f"Behind: {x['dataset']}, {x['storage']}, epoch {x['epoch']}, against {x['against']}: "
                     f"{x['peer']} {num(x['peer_rate'])} vs croupier ({x.get('croupier_variant', 'default')}) "
                     f"{num(x['croupier'])} samples/s (target {x.get('target', 1.0):g}x) "
                     f"({1 / x['ratio']:.2f}x croupier), with an order that is "
                     f"{'uniform' if x['peer_uniform'] else 'NOT uniform'} and {num(x['peer_disk_mb'], '.1f')} MB of local disk.")
    for r in rep["cases"]:
        q = r.get("quality") or {}
        if r["variant"] == "default" and q and not q.get("uniform"):
            facts.append(f"{r['label']}'s default order on {r['dataset']} ({r['condition']['name']}) is not uniform "
                         f"({_rejected_by(q)}): "
                         f"{q['shards_per_batch']:.1f} distinct shards per batch (uniform: "
                         f"{rep['uniform_reference'][r['dataset']]['shards_per_batch']:.1f}), Mosaic entropy "
                         f"{q['mosaic_entropy']['harmonic']:.2f} (uniform: "
                         f"{rep['uniform_reference'][r['dataset']]['mosaic_entropy']['harmonic']:.2f}).")
    for r in rep["cases"]:
        rs = r.get("resume")
        if rs and not rs["exact"]:
            facts.append(f"{r['label']}'s resume on {r['dataset']} ({r['condition']['name']}) lost {rs['lost']} and "
                         f"repeated {rs['repeated']} of {rs['expected']}.")
    chunk = {ds: -(-n // rep["shards"]) for ds, n in (("text", rep["data"]["text_rows"]), ("image", rep["data"]["images"]))}
    small = [ds for ds, c in chunk.items() if c <= 256 and any(r["system"] == "litdata" and r["dataset"] == ds
                                                              for r in rep["cases"])]
    if small:
        facts.append(f"LitData's chunks hold {', '.join(f'{chunk[ds]} {ds} samples' for ds in small)}: no more than its "
                     "default in-chunk shuffle window (256), so its 'strongest' setting is its default here.")
    caveats = [
        "Sizes are modest so the matrix fits on 2 cores: at this size Mosaic's default py1e block (262,144 samples) "
        "covers the whole dataset, so its default shuffle is global here; on 10^8 samples a block is 0.26% of the "
        "data and its order is block-local. LitData's shuffle is chunk-local at any size.",
        "Everything (storage daemon or S3 server, croupier's server, the peers' workers, the tf.data service) shares "
        "the same 2 cores; throughput here is mostly CPU-bound, and runs on a busy machine move by tens of percent.",
        "Epoch 2 of the peers that cache whole shards is served from local disk (their cache holds the whole dataset "
        "here); croupier's server serves what its memory cache holds (default 25% of RAM; its cache10 row: 10% of "
        "the data's bytes) and keeps nothing on the trainer's disk.",
    ]
    if any(r["system"] == "croupier" and r["variant"] == "shards" for r in rep["cases"]):
        caveats.append("croupier's default image rows read the ImageFolder, one file per image, as torchdata and "
                       "dataloader-rs do; its 'images as WebDataset tar shards' rows serve the same JPEGs from the "
                       "tar shards the benchmark's data generator wrote (1,000 images a shard), their offset index "
                       "shipped beside them as a deployment would. Through a bucket mount every file is a lookup "
                       "and a GET or two, so the layout, not the loader, decides the cold epoch there.")
    return "\n".join(f"- {f}" for f in facts + caveats)


def main(argv: list[str] | None = None) -> int:
    """python -m croupier.bench.peers.report results/peers.json: the Markdown and plots again from the JSON."""
    import json
    import sys

    path = Path((argv if argv is not None else sys.argv[1:])[0])
    rep = json.loads(path.read_text())
    rep["goal"] = goal(rep)
    name = path.stem
    made = plots(rep, path.parent, name)
    (path.parent / f"{name}.md").write_text(markdown(rep, made))
    path.write_text(json.dumps(rep, indent=1, default=str))  # its goal, recomputed
    print(f"wrote {path.parent / (name + '.md')} and {len(made)} plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
