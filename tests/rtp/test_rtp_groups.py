"""The process group is honoured: two independent RTP groups of 2 inside a world of 4, under torchrun."""

from __future__ import annotations

from rtp_launch import launch_torchrun


def test_two_groups_of_two_in_a_world_of_four_each_equal_their_own_single_process(tmp_path):
    results = launch_torchrun("two_groups", 4, tmp_path)
    for rank, res in enumerate(results):
        assert res["group_index"] == rank // 2
        for model in ("mlp", "gpt"):
            r = res[model]
            assert (r["group_rank"], r["group_size"]) == (rank % 2, 2)
            assert max(r["loss_err"]) < 1e-9, (rank, model, r["loss_err"])
            for step, (name, err) in enumerate(r["grad_err"]):
                assert err < 1e-9, f"rank {rank} {model} step {step}: gradient of {name} off by {err:.2e}"
            assert r["param_err_after_adam"][1] < 1e-7, (rank, model, r["param_err_after_adam"])
    # Each group trained its own model on its own data.
    assert results[0]["gpt"]["losses"] == results[1]["gpt"]["losses"]
    assert results[0]["gpt"]["losses"] != results[2]["gpt"]["losses"]
