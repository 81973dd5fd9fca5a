"""peers.md and its plots from the suite's JSON (suite.run_peers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..reporting import header_lines, num

#: What a resume cell says for a system that has no resume case (suite.VARIANTS gives it none).
NO_RESUME = {"tfdata": "none: a tf.data service iterator cannot be checkpointed",
             "lance": "none: Lance has no loader state (a take loop keeps its own position)",
             "dataloader-rs": "none: PyDataloader has no state_dict"}
VARIANT_NAMES = {"default": "default", "strongest": "strongest shuffle", "cache10": "cache = 10% of data",
                 "loader": "its torch loader"}


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
            f"| {r['label']} | {VARIANT_NAMES[r['variant']]} | {r['shuffle']} | {_rate_cell(r, 0)} | {_rate_cell(r, 1)} "
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
    if rep["suite"] != "peers":  # the quick run, or the matrix on other (tiny) sizes
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
            "the first downloads). Peak local disk is the cache folder polled every 0.1 s; peak RSS sums every "
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
    for f in made:
        out += [f"![{f}]({f})", ""]
    gt = goal_table(rep.get("goal") or [])
    if gt:
        out += ["## The goal: croupier's throughput against the peers'", "",
                "Epoch rates; 'uniform peers' are the peer rows whose delivered order passed the uniformity tests "
                "(equal shuffle quality), 'any peer' the fastest row whatever its quality, '10% cache' the peers "
                "with their cache limited (croupier's row is its default: it keeps no local cache), 'Lance' Lance's "
                "fastest row (its take of a global permutation, or its torch loader).", "", gt, ""]
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
    """The issue's goal as numbers, per storage and dataset: croupier's epoch rates against every
    peer row whose delivered order passed the uniformity tests (equal quality), against the
    best peer row whatever its quality, in the 10% cache condition (croupier's row there is
    its default: it keeps no cache), and against Lance's best row (issue 21)."""
    out = []
    for cond in dict.fromkeys(r["condition"]["name"] for r in rep["cases"]):
        for ds in ("text", "image"):
            rows = _rows(rep, cond, ds)
            cr = next((r for r in rows if r["system"] == "croupier" and r["variant"] == "default"), None)
            if cr is None:
                continue
            for epoch in (0, 1):
                mine = _rate(cr, epoch)
                if mine is None:
                    continue
                peers = [r for r in rows if r["system"] != "croupier" and _rate(r, epoch)]
                uniform = [r for r in peers if (r.get("quality") or {}).get("uniform")]
                small = [r for r in peers if r["variant"] == "cache10"]
                lance = [r for r in peers if r["system"] == "lance"]  # issue 21: at least Lance's, everywhere
                for kind, group in (("uniform peers", uniform), ("any peer", peers), ("10% cache", small),
                                    ("Lance", lance)):
                    if not group:
                        continue
                    best = max(group, key=lambda r: _rate(r, epoch))
                    out.append({"storage": cond, "dataset": ds, "epoch": epoch + 1, "against": kind,
                                "croupier": mine, "peer": f"{best['label']} ({VARIANT_NAMES[best['variant']]})",
                                "peer_rate": _rate(best, epoch), "ratio": mine / _rate(best, epoch),
                                "met": mine >= _rate(best, epoch),
                                "peer_uniform": bool((best.get("quality") or {}).get("uniform")),
                                "peer_disk_mb": best.get("peak_local_disk_mb")})
    return out


def goal_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = ["| storage | dataset | epoch | against | croupier samples/s | best of them | its samples/s | croupier / it "
             "| its order uniform? | its peak disk MB |", "|---" * 10 + "|"]
    for g in rows:
        lines.append(f"| {g['storage']} | {g['dataset']} | {g['epoch']} | {g['against']} | {num(g['croupier'])} | {g['peer']} "
                     f"| {num(g['peer_rate'])} | {g['ratio']:.2f}x{'' if g['met'] else ' (behind)'} "
                     f"| {'yes' if g['peer_uniform'] else 'no'} | {num(g['peer_disk_mb'], '.1f')} |")
    return "\n".join(lines)


def reading(rep: dict[str, Any]) -> str:
    """Facts read off the figures (generated, so they match them), then the caveats that always hold."""
    facts = []
    g = rep.get("goal") or []
    behind = [x for x in g if not x["met"]]
    if g:
        facts.append(f"croupier's epoch rate is at least the best peer's in {len(g) - len(behind)} of {len(g)} "
                     "comparisons of the goal table.")
    for x in behind:
        facts.append(f"Behind: {x['dataset']}, {x['storage']}, epoch {x['epoch']}, against {x['against']}: "
                     f"{x['peer']} {num(x['peer_rate'])} vs croupier {num(x['croupier'])} samples/s "
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
        "here); croupier reads the slow storage again every epoch and keeps nothing on disk.",
    ]
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
    print(f"wrote {path.parent / (name + '.md')} and {len(made)} plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
