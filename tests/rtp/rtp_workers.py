"""Worker programs for the RTP tests: `python rtp_workers.py SCENARIO OUT_DIR`, one process per rank.

Launched with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (by the tests' launcher
or by torchrun). Each rank compares its RTP model against a single-process reference
built from the same seed and trained on the concatenation of every rank's micro-batch,
and writes the measured differences to OUT_DIR/rank{r}.pt for the tests to judge.
"""

from __future__ import annotations

import copy
import sys
import warnings
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rtp_models import CASES, EDGE, WIDE_CNN, global_batch, micro_batch  # noqa: E402

from croupier.client.rtp import Position, ReplicatedLayerWarning, RotatedTensorParallel, state_bytes  # noqa: E402
from croupier.client.rtp import destroy_process_group  # noqa: E402

MICRO = 2
STEPS = 5
# Small enough that the CNN's convolutions and the transformer's embedding/head, MLP and
# LayerNorms rotate in slices; the MLP rotates whole shards.
CHUNK_BYTES = {"mlp": None, "cnn": 256, "gpt": 8192}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the reference's scale (0 for two empty tensors)."""
    if want.numel() == 0:
        return 0.0
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def worst(errs: dict[str, float]) -> tuple[str, float]:
    return max(errs.items(), key=lambda kv: kv[1])


def local_expected(rtp: RotatedTensorParallel, name: str, full: torch.Tensor) -> torch.Tensor:
    split = rtp.sharding()[name]
    return full if split is None else split.take(full, rtp.rank)


def grad_errors(rtp: RotatedTensorParallel, ref: nn.Module) -> dict[str, float]:
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    return {name: rel_err(p.grad, local_expected(rtp, name, ref_params[name].grad))
            for name, p in rtp.module.named_parameters(remove_duplicate=False)}


def as_dtype(batch: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


def train_and_compare(case_name: str, out: Path, steps: int, group: dist.ProcessGroup | None = None,
                      seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    case = CASES[case_name]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(seed)
    model = case.build().to(dtype)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rtp = RotatedTensorParallel(model, group, chunk_bytes=CHUNK_BYTES[case_name])
    res: dict[str, Any] = {
        "replicated_warnings": [str(w.message) for w in caught if issubclass(w.category, ReplicatedLayerWarning)],
        "group_rank": rtp.rank, "group_size": rtp.world_size,
        "n_sharded": sum(s is not None for s in rtp.sharding().values()),
        "n_params": len(rtp.sharding()),
    }
    opt = torch.optim.Adam(rtp.parameters(), lr=1e-3)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    res["loss_err"], res["grad_err"] = [], []
    for step in range(steps + 1):
        x, y = as_dtype(global_batch(case, step, world, MICRO, seed), dtype)
        ref_opt.zero_grad()
        ref_loss = case.loss(ref(x), y)
        ref_loss.backward()
        opt.zero_grad()
        loss = case.loss(rtp(micro_batch(x, rank, MICRO)), micro_batch(y, rank, MICRO))
        loss.backward()
        if dtype == torch.float64:  # clipping by the whole model's norm, reduced over ranks
            if step == 0:
                inf_norm = rtp.clip_grad_norm_(1e9, norm_type=float("inf"))
                want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=float("inf"))
                res["clip_inf_norm_err"] = rel_err(inf_norm, want)
            norm = rtp.clip_grad_norm_(0.5)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            res.setdefault("clip_norm_err", []).append(rel_err(norm, want))
            res.setdefault("clip_norms", []).append(want.item())
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        res["loss_err"].append(abs(mean.item() / world - ref_loss.item()) / max(abs(ref_loss.item()), 1e-6))
        res.setdefault("losses", []).append(ref_loss.item())
        errs = grad_errors(rtp, ref)
        if step == 0:
            res["first_grad_errs"] = errs
        res["grad_err"].append(worst(errs))
        if step == steps:
            res["state"] = rtp.state_bytes(opt)
            res["whole_state"] = state_bytes(ref, ref_opt)
            res["ring_bound"] = rtp.ring_buffer_bound()
            res["largest_chunk_bytes"] = max(
                layer.max_chunk_numel * layer.dtype.itemsize for layer in rtp.rotating_layers)
            res["largest_shard_bytes"] = max(
                layer.max_numel * layer.dtype.itemsize for layer in rtp.rotating_layers)
            res["n_chunked_layers"] = sum(len(layer.chunks) > 1 for layer in rtp.rotating_layers)
            break
        opt.step()
        ref_opt.step()

    full = rtp.full_state_dict()
    ref_sd = ref.state_dict()
    res["full_keys"], res["ref_keys"] = list(full), list(ref_sd)
    res["param_err_after_adam"] = worst({k: rel_err(full[k], ref_sd[k]) for k in ref_sd})
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    res["own_shard_err_after_adam"] = worst({
        name: rel_err(p, local_expected(rtp, name, ref_params[name].detach()))
        for name, p in rtp.module.named_parameters(remove_duplicate=False)})

    if dtype == torch.float32:
        res.update(eval_checks(rtp, ref, case, world, seed))
        res.update(checkpoint_checks(rtp, opt, case, out / f"{case_name}-ckpt-{seed}", world, seed))
    return res


def eval_checks(rtp: RotatedTensorParallel, ref: nn.Module, case: Any, world: int, seed: int) -> dict[str, Any]:
    x, _ = global_batch(case, 99, world, MICRO, seed)
    mine = micro_batch(x, rtp.rank, MICRO)
    before = {n: p.detach().clone() for n, p in rtp.module.named_parameters()}
    rtp.eval()
    ref.eval()
    with torch.no_grad():
        first, second = rtp(mine), rtp(mine)
        want = micro_batch(ref(x), rtp.rank, MICRO)
    with_grad_mode = rtp(mine)  # eval() alone, autograd on, never backpropagated
    rtp.train()
    ref.train()
    return {
        "eval_repeat_equal": torch.equal(first, second) and torch.equal(first, with_grad_mode.detach()),
        "eval_vs_ref_err": rel_err(first, want),
        "eval_weights_unchanged": all(torch.equal(before[n], p) for n, p in rtp.module.named_parameters()),
        "eval_all_home": all(layer.position is Position.HOME and layer.visiting is None
                             for layer in rtp.rotating_layers),
        # the shard this rank computes with at step k is the one that `holder` places here
        "rotation_bookkeeping": all(layer.holder(layer.shard_at(k, d), k, d) == rtp.rank
                                    for layer in rtp.rotating_layers for k in range(world) for d in (1, -1)),
    }


def checkpoint_checks(rtp: RotatedTensorParallel, opt: torch.optim.Optimizer, case: Any, path: Path,
                      world: int, seed: int) -> dict[str, Any]:
    saved = {n: p.detach().clone() for n, p in rtp.module.named_parameters()}
    saved_opt = copy.deepcopy(opt.state_dict())
    rtp.save_sharded(path, opt)
    with torch.no_grad():
        for p in rtp.parameters():
            p.mul_(0.0)
    for state in opt.state.values():
        state["exp_avg"].zero_()
    rtp.load_sharded(path, opt)
    restored = all(torch.equal(saved[n], p) for n, p in rtp.module.named_parameters())
    opt_restored = all(torch.equal(a["exp_avg"], b["exp_avg"])
                       for a, b in zip(saved_opt["state"].values(), opt.state_dict()["state"].values()))

    torch.manual_seed(seed + 4242)
    other = case.build()
    rtp.load_full_state_dict(other.state_dict())
    back = rtp.full_state_dict()
    other_sd = other.state_dict()
    x, _ = global_batch(case, 77, world, MICRO, seed)
    with torch.no_grad():
        got = rtp(micro_batch(x, rtp.rank, MICRO))
        want = micro_batch(other(x), rtp.rank, MICRO)
    return {
        "sharded_ckpt_restored": restored,
        "sharded_ckpt_opt_restored": opt_restored,
        "full_import_export_err": worst({k: rel_err(back[k], other_sd[k]) for k in other_sd}),
        "full_import_keys_equal": list(back) == list(other_sd),
        "full_import_output_err": rel_err(got, want),
    }


class AttentionVariants(nn.Module):
    """Cross-attention (kdim/vdim, bias_kv, zero_attn, seq-first, padding mask, per-head weights),
    self-attention with a per-head 3-D float mask, and a stock nn.TransformerEncoderLayer."""

    def __init__(self) -> None:
        super().__init__()
        self.cross = nn.MultiheadAttention(12, 3, kdim=7, vdim=5, add_bias_kv=True, add_zero_attn=True)
        self.self_attn = nn.MultiheadAttention(12, 3, batch_first=True)
        self.encoder = nn.TransformerEncoderLayer(12, 4, dim_feedforward=19, dropout=0.0, batch_first=True)

    def forward(self, q, k, v, padding, mask):
        a, w_cross = self.cross(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), key_padding_mask=padding,
                                need_weights=True, average_attn_weights=False)
        a = a.transpose(0, 1)
        b, w_self = self.self_attn(a, a, a, attn_mask=mask, need_weights=True)
        return self.encoder(b), w_cross, w_self


def attention_variants(out: Path) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    model = AttentionVariants()
    ref = copy.deepcopy(model)
    rtp = RotatedTensorParallel(model)
    g = torch.Generator().manual_seed(11)
    n = world * MICRO
    q, k, v = torch.randn(n, 6, 12, generator=g), torch.randn(n, 8, 7, generator=g), torch.randn(n, 8, 5, generator=g)
    padding = torch.rand(n, 8, generator=g) < 0.3
    padding[:, 0] = False
    mask = torch.randn(n * 3, 6, 6, generator=g)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    # A random weighting, not out.pow(2): right after a LayerNorm that loss is nearly constant.
    weighting = torch.randn(n, 6, 12, generator=g)
    ref_out, ref_wc, ref_ws = ref(*inputs, padding, mask)
    ref_out.mul(weighting).mean().backward()

    def mine(t: torch.Tensor, per: int = 1) -> torch.Tensor:
        return t[rank * MICRO * per:(rank + 1) * MICRO * per]

    local = [mine(t).clone().requires_grad_() for t in (q, k, v)]
    out, wc, ws = rtp(*local, mine(padding), mine(mask, 3))
    out.mul(mine(weighting)).mean().backward()
    res = {
        "out_err": rel_err(out, mine(ref_out)),
        "cross_weights_err": rel_err(wc, mine(ref_wc)),
        "self_weights_err": rel_err(ws, mine(ref_ws)),
        # the rank's loss is a mean over MICRO samples, the reference's over world * MICRO
        "input_grad_err": worst({str(i): rel_err(a.grad / world, mine(b.grad)) for i, (a, b)
                                 in enumerate(zip(local, inputs))}),
        "grad_err": worst(grad_errors(rtp, ref)),
    }
    rtp.eval()
    ref.eval()
    with torch.no_grad():
        x = mine(ref_out.detach())
        res["encoder_eval_err"] = rel_err(rtp.module.encoder(x), ref.encoder(x))
    return res


def dropout_gradient(out: Path) -> dict[str, Any]:
    """With attention dropout, backward must replay each piece's dropout mask.

    Checked against a central difference of the same seeded objective (float64): a
    backward that drew new masks would differentiate a different function.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(5)
    rtp = RotatedTensorParallel(nn.MultiheadAttention(12, 3, dropout=0.4, batch_first=True).double())
    x = torch.randn(MICRO, 5, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))

    def objective() -> torch.Tensor:
        torch.manual_seed(1234 + rank)
        return rtp(x, x, x, need_weights=False)[0].pow(2).mean()

    objective().backward()
    g = torch.Generator().manual_seed(99 + rank)
    direction = [torch.randn(p.shape, dtype=p.dtype, generator=g) for p in rtp.parameters()]
    slope = sum((p.grad * d).sum() for p, d in zip(rtp.parameters(), direction))
    dist.all_reduce(slope)
    eps = 1e-6
    with torch.no_grad():
        for p, d in zip(rtp.parameters(), direction):
            p.add_(eps * d)
        plus = objective()
        for p, d in zip(rtp.parameters(), direction):
            p.sub_(2 * eps * d)
        minus = objective()
    fd = (plus - minus) / (2 * eps)
    dist.all_reduce(fd)
    fd /= world  # gradients are the mean over ranks
    return {"dropout_fd_err": (abs(fd - slope) / abs(slope)).item()}


def model_state_of_wide_cnn() -> dict[str, Any]:
    """Per-rank model state of the widened CNN after one Adam step, and the whole model's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = WIDE_CNN.build()
    ref = copy.deepcopy(model)
    rtp = RotatedTensorParallel(model)
    opt, ref_opt = torch.optim.Adam(rtp.parameters()), torch.optim.Adam(ref.parameters())
    x, y = global_batch(WIDE_CNN, 0, world, MICRO)
    WIDE_CNN.loss(rtp(micro_batch(x, rank, MICRO)), micro_batch(y, rank, MICRO)).backward()
    WIDE_CNN.loss(ref(x), y).backward()
    opt.step()
    ref_opt.step()
    return {"state": rtp.state_bytes(opt), "whole_state": state_bytes(ref, ref_opt),
            "n_sharded": sum(s is not None for s in rtp.sharding().values()), "n_params": len(rtp.sharding())}


def equivalence(out: Path) -> dict[str, Any]:
    res = {name: train_and_compare(name, out, 1) for name in CASES}
    res["cnn_wide"] = model_state_of_wide_cnn()
    # Adam divides by sqrt(v): parameters with a gradient that is zero in exact arithmetic (the
    # key bias of attention) follow float32 rounding noise to +-lr per step, identically wrong in
    # both models only by chance. Trajectories are therefore compared in float64.
    res["float64"] = {name: train_and_compare(name, out, STEPS, dtype=torch.float64) for name in CASES}
    res["attention"] = attention_variants(out)
    res["dropout"] = dropout_gradient(out)
    return res


def two_groups(out: Path) -> dict[str, Any]:
    """World of 4 as two independent RTP groups of 2, each with its own data."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    index = dist.get_rank() // 2
    return {"group_index": index,
            **{name: train_and_compare(name, out, 2, groups[index], seed=index + 1, dtype=torch.float64)
               for name in ("mlp", "gpt")}}


# Every torch.distributed entry point that is not point-to-point, and every ProcessGroup
# method that communicates (all of torch.distributed's Python API ends in one of them).
API_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_reduce_coalesced",
                   "all_to_all", "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather",
                   "gather_object", "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                   "scatter", "scatter_object_list")
API_P2P = ("batch_isend_irecv", "send", "recv")  # not isend/irecv: P2POp accepts only the originals
PG_COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
                  "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced",
                  "all_to_all_single", "alltoall", "alltoall_base", "barrier", "monitored_barrier", "broadcast",
                  "gather", "scatter", "reduce", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
                  "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")
PG_P2P = ("send", "recv", "recv_anysource")


class CommLog:
    """Wraps torch.distributed's functions and ProcessGroup's methods (until `restore()`) and
    records this process's calls while `recording()`:
    ("api", name) for public functions, ("pg", name) for ProcessGroup collectives, and
    ("send", peer, numel, tag) / ("recv", peer, numel, tag) for every point-to-point message
    (peers as group ranks)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._active = False
        self._originals: list[tuple[Any, str, Any]] = []
        pg = dist.ProcessGroup
        present = [n for n in PG_COLLECTIVES if hasattr(pg, n)]
        assert {"allreduce", "allgather", "broadcast", "barrier", "reduce_scatter"} <= set(present)
        for name in API_COLLECTIVES + API_P2P:
            self._wrap(dist, name, lambda name, a, k: ("api", name))
        for name in present:
            self._wrap(pg, name, lambda name, a, k: ("pg", name))
        for name in PG_P2P:
            # ProcessGroup.send(tensors, dstRank, tag) / recv(tensors, srcRank, tag)
            self._wrap(pg, name, lambda name, a, k: (name[:4], a[2] if len(a) > 2 else -1,
                                                     sum(t.numel() for t in a[1]), a[3] if len(a) > 3 else 0))

    def _wrap(self, owner: Any, name: str, entry: Any) -> None:
        original = getattr(owner, name)
        # Restored from the class __dict__: pybind11 methods must go back as their descriptor.
        self._originals.append((owner, name, vars(owner).get(name, original)))

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._active:
                self.calls.append(entry(name, args, kwargs))
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    @contextmanager
    def recording(self):
        self._active = True
        try:
            yield self
        finally:
            self._active = False

    def restore(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)


def collectives(calls: list[tuple]) -> list[tuple]:
    return [c for c in calls if c[0] in ("api", "pg") and c[1] not in API_P2P]


def edge_cases(out: Path) -> dict[str, Any]:
    """N=3: the edge-case model against one process in float64 (two optimizer steps, each
    accumulating two micro-steps), with every torch.distributed call logged: while wrapping
    (without sync_module_states) and during forward and backward, here and for the GPT and
    MLP models."""
    rank, world = dist.get_rank(), dist.get_world_size()
    log = CommLog()
    res: dict[str, Any] = {}
    torch.manual_seed(0)  # every rank builds the same weights: no broadcast needed
    model = EDGE.build().double()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught, log.recording():
        warnings.simplefilter("always")
        rtp = RotatedTensorParallel(model, sync_module_states=False)
    res["wrap_calls"], log.calls = log.calls, []
    res["replicated_warnings"] = [str(w.message) for w in caught if issubclass(w.category, ReplicatedLayerWarning)]
    res["shard_shapes"] = {name: tuple(p.shape) for name, p in rtp.module.named_parameters()}
    res["n_sharded"] = sum(s is not None for s in rtp.sharding().values())
    res["n_params"] = len(rtp.sharding())
    frozen_before = rtp.module.frozen.weight.detach().clone()
    opt = torch.optim.Adam(rtp.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    res["loss_err"], res["grad_err"], res["frozen_grad_is_none"] = [], [], []
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):  # gradient accumulation: two backward passes per step
            x, y = as_dtype(global_batch(EDGE, 2 * step + micro, world, MICRO), torch.float64)
            ref_loss = EDGE.loss(ref(x), y)
            ref_loss.backward()
            with log.recording():
                loss = EDGE.loss(rtp(micro_batch(x, rank, MICRO)), micro_batch(y, rank, MICRO))
                loss.backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            res["loss_err"].append(abs(mean.item() / world - ref_loss.item()))
        res["grad_err"].append(worst({n: e for n, e in grad_errors_or_none(rtp, ref).items()}))
        res["frozen_grad_is_none"].append(rtp.module.frozen.weight.grad is None and ref.frozen.weight.grad is None)
        opt.step()
        ref_opt.step()
    res["edge_train_calls"], log.calls = log.calls, []
    full, ref_sd = rtp.full_state_dict(), ref.state_dict()
    res["param_err_after_adam"] = worst({k: rel_err(full[k], ref_sd[k]) for k in ref_sd})
    res["frozen_unchanged"] = torch.equal(rtp.module.frozen.weight, frozen_before)

    for name in ("gpt", "mlp"):  # one float32 training step each, forward and backward logged
        case = CASES[name]
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReplicatedLayerWarning)
            wrapped = RotatedTensorParallel(case.build(), chunk_bytes=CHUNK_BYTES[name])
        x, y = global_batch(case, 0, world, MICRO)
        with log.recording():
            case.loss(wrapped(micro_batch(x, rank, MICRO)), micro_batch(y, rank, MICRO)).backward()
        res[f"{name}_train_calls"], log.calls = log.calls, []
        res[f"{name}_n_replicated"] = sum(s is None for s in wrapped.sharding().values())

    # Ranks that wrap different models are told so at wrap time instead of deadlocking later.
    try:
        RotatedTensorParallel(nn.Linear(4, 3 + rank))
        res["mismatch_error"] = None
    except RuntimeError as exc:
        res["mismatch_error"] = str(exc)
    log.restore()
    return res


def grad_errors_or_none(rtp: RotatedTensorParallel, ref: nn.Module) -> dict[str, float]:
    """As `grad_errors`, with a parameter that has no gradient in both models counting as equal."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    errs = {}
    for name, p in rtp.module.named_parameters(remove_duplicate=False):
        want = ref_params[name].grad
        if want is None or p.grad is None:
            errs[name] = 0.0 if want is None and p.grad is None else float("inf")
        else:
            errs[name] = rel_err(p.grad, local_expected(rtp, name, want))
    return errs


def gloo_threads() -> list[str]:
    """Names of this process's gloo threads (the process group's workers and its TCP loop)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended while listed
            pass
    return sorted(n for n in names if "gloo" in n)


def teardown(out: Path) -> dict[str, Any]:
    """destroy_process_group while a trained RTP model is still referenced: the group must
    really go (its threads joined) then, not at interpreter exit, where a gloo worker still
    releasing a tensor aborts the process."""
    rtp = RotatedTensorParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    rtp(torch.randn(4, 8)).sum().backward()
    rtp.clip_grad_norm_(1.0, norm_type=float("inf"))
    before = gloo_threads()
    dist.destroy_process_group()
    return {"before": before, "after": gloo_threads(), "model": rtp}


SCENARIOS = {"equivalence": equivalence, "two_groups": two_groups, "edge_cases": edge_cases, "teardown": teardown}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        rank = dist.get_rank()
        result = SCENARIOS[scenario](out)
        result.pop("model", None)
        torch.save(result, out / f"rank{rank}.pt")
        if dist.is_initialized():
            dist.barrier()
    finally:
        destroy_process_group()


if __name__ == "__main__":
    main()
