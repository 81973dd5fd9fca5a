"""torchtitan-style checkpoints: the Loader's position saved and restored with torch.distributed.checkpoint.

Real gloo process groups (torch.multiprocessing), a real `croupier serve` on loopback and
real `dcp.save`/`dcp.load` folders. `LoaderStates(loader)` must bring each rank back to
exactly where it stood at the same world size, and, at another world size, deal exactly
the samples no old rank delivered, with `in_order=False` (which needs every old rank's
state) included. examples/train_rtp_dcp.py, stopped mid-epoch and resumed, must train on
the same batches with the same losses as a run that was never stopped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from torch.distributed.checkpoint.stateful import Stateful

from croupier.client import Loader
from croupier.client.dcp_state import LoaderStates, _by_rank
from croupier.protocol.epoch_plan import EpochPlan
from dcp_jobs import make_tokens, run_example, steps_logged

ROWS, BATCH, SEED = 60, 3, 5


def _worker(rank: int, world: int, store: str, server: str, ckpt: str, phase: str, stop_after: int,
            in_order: bool, out: str) -> None:
    """One rank: load the checkpoint (phase "load"), hand out batches, save it (phase "save")."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    loader = Loader("text", servers=server, batch_size=BATCH, seed=SEED, in_order=in_order, prefetch=8)
    state = {"dataloader": LoaderStates(loader)}
    if phase == "load":
        dcp.load(state, checkpoint_id=ckpt)
    got = []
    for b in loader.batches():
        got.append({"batch": b.batch, "indices": b.indices[~b.padding].tolist()})
        if len(got) == stop_after:
            break
    if phase == "save":
        dcp.save(state, checkpoint_id=ckpt)
    Path(out, f"{phase}-rank{rank}.json").write_text(json.dumps(got))
    loader.close()
    dist.destroy_process_group()


def _run(world: int, tmp: Path, server: str, phase: str, stop_after: int, in_order: bool) -> list[list[dict]]:
    store = tmp / f"store-{phase}"
    mp.spawn(_worker, args=(world, str(store), server, str(tmp / "ckpt"), phase, stop_after, in_order, str(tmp)),
             nprocs=world, join=True)
    return [json.loads((tmp / f"{phase}-rank{r}.json").read_text()) for r in range(world)]


def _save_then_load(serve_process, tmp: Path, saved_world: int, stop_after: int, loaded_world: int,
                    in_order: bool) -> tuple[list[list[dict]], list[list[dict]]]:
    """Batches each rank handed out before `dcp.save` (stop_after each), and after `dcp.load` to the epoch's end."""
    server = serve_process([f"text={make_tokens(tmp / 'text', ROWS)}"]).address
    return (_run(saved_world, tmp, server, "save", stop_after, in_order),
            _run(loaded_world, tmp, server, "load", 0, in_order))


def test_the_loader_and_loader_states_are_dcp_statefuls() -> None:
    loader = Loader("text", batch_size=2, rank=0, world_size=1)
    assert isinstance(loader, Stateful)
    assert isinstance(LoaderStates(loader), Stateful)


@pytest.mark.parametrize("in_order", [True, False])
def test_dcp_resume_at_the_same_world_size_puts_every_rank_back_where_it_stood(serve_process, tmp_path: Path,
                                                                              in_order: bool) -> None:
    before, after = _save_then_load(serve_process, tmp_path, 2, 3, 2, in_order)
    per_rank = EpochPlan(ROWS, SEED, 0, BATCH, 2).num_batches
    for rank in range(2):
        batches = [b["batch"] for b in before[rank] + after[rank]]
        assert sorted(batches) == list(range(per_rank)), f"rank {rank}: {batches}"
        plan = EpochPlan(ROWS, SEED, 0, BATCH, 2)
        for b in before[rank] + after[rank]:  # each rank got its own rank's batches back
            rb = plan.rank_batch(rank, b["batch"])
            assert b["indices"] == rb.indices[~rb.padding].tolist()


@pytest.mark.parametrize("in_order", [True, False])
def test_dcp_checkpoint_of_2_ranks_resumed_at_3_delivers_the_rest_of_the_epoch_once(serve_process, tmp_path: Path,
                                                                                    in_order: bool) -> None:
    before, after = _save_then_load(serve_process, tmp_path, 2, 4, 3, in_order)
    seen = [i for rank in before + after for b in rank for i in b["indices"]]
    assert len(seen) == ROWS and sorted(seen) == list(range(ROWS))


def test_loader_states_name_a_missing_or_disagreeing_rank() -> None:
    s0, s1 = {"rank": 0, "step": 2}, {"rank": 1, "step": 2}
    assert _by_rank([s1, s0, dict(s1)], 2) == [s0, s1]  # a replica of rank 1 (tensor parallel) is kept once
    with pytest.raises(ValueError, match=r"ranks \[0\] of a world of 2"):
        _by_rank([s0], 2)
    with pytest.raises(ValueError, match="Loader rank 1 at different states"):
        _by_rank([s0, s1, {"rank": 1, "step": 3}], 2)


def test_rtp_dcp_example_saved_mid_epoch_and_restarted_continues_exactly(serve_process, tmp_path: Path) -> None:
    server = serve_process([f"text={make_tokens(tmp_path / 'text', 40)}"]).address
    common = ["--batch-size", "2", "--epochs", "2", "--checkpoint-every", "100", "--seed", "3"]
    whole = run_example(2, server, tmp_path / "whole", *common)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    first = run_example(2, server, tmp_path / "parts", *common, "--max-steps", "7")  # 10 steps an epoch
    assert first.returncode == 0, first.stdout + first.stderr
    second = run_example(2, server, tmp_path / "parts", *common)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming at step 7" in second.stdout and "finished at step 20" in second.stdout

    def steps(folder: str) -> list[tuple]:
        return sorted((s["rank"], s["step"], s["epoch"], s["batch"], s["indices"], s["loss"])
                      for s in steps_logged(tmp_path / folder, 2))

    assert steps("parts") == steps("whole")  # the same batches, the same losses, bit for bit
