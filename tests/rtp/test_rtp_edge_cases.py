"""RTP's core claims, checked on what the ranks actually did (one job of N=3 real processes, gloo).

- Training is point-to-point only: no collective runs during forward and backward of a
  fully sharded model; with a replicated layer, exactly one all-reduce per replicated
  parameter (its gradient average). Every torch.distributed function and every
  communicating ProcessGroup method is wrapped in the worker processes and counted.
- Every message is matched: what rank a sends to rank b, in order, is exactly what b
  receives from a (sizes, tags), only between ring neighbours, never an empty message:
  empty shards are skipped by both sides alike.
- The group's first call is a collective of every rank, made at wrap time even without
  sync_module_states: torch requires every rank to take part in a group's first call if
  it is a batch_isend_irecv (NCCL creates the communicator there), and ring shifts leave
  out ranks whose shards are empty. The same call refuses ranks that wrapped different models.
- A model with empty shards (sizes below N), a layer used twice per forward, a frozen
  weight, and gradient accumulation over two micro-steps matches one process in float64.

See `edge_cases` in rtp_workers.py for what each rank measures.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from rtp_launch import launch

N = 3
F64_TOL = 1e-9


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch("edge_cases", N, tmp_path_factory.mktemp("rtp-edge"))


def _collectives(calls: list[tuple]) -> list[tuple]:
    return [c for c in calls if c[0] in ("api", "pg") and c[1] != "batch_isend_irecv"]


def _p2p(calls: list[tuple]) -> list[tuple]:
    return [c for c in calls if c[0] in ("send", "recv")]


@pytest.mark.parametrize("model", ["edge", "gpt"])
def test_forward_and_backward_of_a_sharded_model_run_no_collective(ranks, model):
    for rank, res in enumerate(ranks):
        calls = res[f"{model}_train_calls"]
        assert _collectives(calls) == [], f"rank {rank} {model}: {_collectives(calls)}"
        assert len(_p2p(calls)) > 0 and ("api", "batch_isend_irecv") in calls
    assert all(res["gpt_n_replicated"] == 0 for res in ranks)


def test_a_replicated_parameter_costs_exactly_one_all_reduce_of_its_gradient(ranks):
    for res in ranks:
        assert res["mlp_n_replicated"] == 1  # PReLU's weight
        assert _collectives(res["mlp_train_calls"]) == [("api", "all_reduce"), ("pg", "allreduce")]


@pytest.mark.parametrize("model", ["edge", "gpt", "mlp"])
def test_every_message_is_received_as_sent_between_ring_neighbours(ranks, model):
    sent: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    received: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for rank, res in enumerate(ranks):
        for kind, peer, numel, tag in _p2p(res[f"{model}_train_calls"]):
            assert peer in ((rank + 1) % N, (rank - 1) % N), (rank, kind, peer)
            assert numel > 0, f"rank {rank} {model}: an empty message ({kind} with {peer})"
            if kind == "send":
                sent[(rank, peer)].append((numel, tag))
            else:
                received[(peer, rank)].append((numel, tag))
    # Compared in order per pair: NCCL ignores tags and matches a pair's messages by order alone.
    assert dict(sent) == dict(received)


def test_the_groups_first_call_is_a_collective_of_every_rank_even_without_sync(ranks):
    wraps = [res["wrap_calls"] for res in ranks]
    for rank, calls in enumerate(wraps):
        assert calls, f"rank {rank} made no call while wrapping"
        assert calls[0][0] in ("api", "pg") and calls[0][1] != "batch_isend_irecv", (rank, calls)
        assert _p2p(calls) == [] and ("api", "batch_isend_irecv") not in calls, (rank, calls)
    assert all(calls == wraps[0] for calls in wraps)  # the same collectives on every rank
    # ...which matters: this model's empty shards make ranks sit out some ring shifts.
    counts = {len(_p2p(res["edge_train_calls"])) for res in ranks}
    assert len(counts) > 1, counts


def test_ranks_that_wrap_different_models_are_refused_at_wrap_time(ranks):
    for res in ranks:
        assert res["mismatch_error"] is not None and "planned different layers" in res["mismatch_error"]


def test_empty_shards_reuse_frozen_weight_and_accumulation_match_one_process_in_float64(ranks):
    shapes = [res["shard_shapes"] for res in ranks]
    assert sum(s["emb.weight"][1] == 0 for s in shapes) == 2  # 1 column over 3 ranks
    assert any(s["attn.in_proj_weight"][0] == 0 for s in shapes)  # 2 heads: a headless shard
    assert any(s["conv.weight"][0] == 0 for s in shapes) and any(s["out.weight"][0] == 0 for s in shapes)
    for rank, res in enumerate(ranks):
        assert res["replicated_warnings"] == [] and res["n_sharded"] == res["n_params"]
        assert max(res["loss_err"]) < F64_TOL, (rank, res["loss_err"])
        assert len(res["grad_err"]) == 2
        for step, (name, err) in enumerate(res["grad_err"]):
            assert err < F64_TOL, f"rank {rank} step {step}: accumulated gradient of {name} off by {err:.2e}"
        assert all(res["frozen_grad_is_none"]) and res["frozen_unchanged"], rank
        name, err = res["param_err_after_adam"]
        assert err < 1e-7, f"rank {rank}: {name} off by {err:.2e} after 2 Adam steps"


def test_destroy_process_group_joins_gloo_threads_while_the_model_lives(tmp_path):
    # A model holding the world group kept it alive past destroy_process_group; its threads
    # then died inside interpreter exit and the rank aborted now and then (exit -6).
    for res in launch("teardown", 2, tmp_path):
        assert "pt_gloo_runloop" in res["before"]
        assert res["after"] == []
