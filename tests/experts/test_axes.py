"""The five-axes table is the chapters' own formulas; the load-balancing run balances."""

import pytest
import torch

import gpucourse as gc


def test_axes_rows_come_from_each_chapters_formula():
    kw = dict(layers=4, hidden=64, ffn_hidden=128, heads=4, seq=256, batch=2, num_experts=8, top_k=2, degree=4)
    rows = {r["axis"]: r for r in gc.parallelism_axes(**kw, zero_stage=1, dtype_bytes=2)}
    experts = 4 * 8 * 2 * 64 * 128
    params = 4 * (4 * 64 * 64 + 64 * 8) + experts
    assert rows["DP/ZeRO-1"]["bytes"] == gc.zero_comm_bytes(params * 2, 4, 1)
    assert rows["DP/ZeRO-1"]["states"] == gc.zero_memory(params, 4, 1)
    assert rows["TP"]["bytes"] == gc.ring_all_reduce_bytes(gc.tp_comm_bytes(2, 256, 64, 4, 4, 2), 4)
    assert rows["TP"]["NVLink"] == gc.tp_comm_time(2, 256, 64, 4, 4, gc.LINKS["NVLink"], 2)
    assert rows["PP"]["bytes"] == 2 * 2 * 256 * 64 * 2                    # one activation + one gradient, whole batch
    assert rows["EP"]["bytes"] == 4 * gc.ep_comm_bytes(tokens=128, d_model=64, world_size=4, top_k=2, dtype_bytes=2)["total"]
    assert rows["EP"]["states"] == gc.zero_memory(params - experts + experts // 4, 1, 0)
    assert rows["CP"]["states_saved"] == 0 and 0 < rows["EP"]["states_saved"] < rows["TP"]["states_saved"]
    try:
        from gpucourse.long_context import cp_comm_bytes
    except ImportError:
        assert rows["CP"]["bytes"] is None
    else:
        assert rows["CP"]["bytes"] == 4 * cp_comm_bytes(batch=2, heads=4, seq=256, head_dim=16, world_size=4,
                                                        dtype_bytes=2)["total"]
        # the same messages as chapter 11's A6 table (cp_comm_time): 3N − 2 per layer, not 2(N − 1) ring steps
        one = gc.cp_comm_time(gc.LINKS["NVLink"], batch=2, heads=4, seq=256, head_dim=16, world_size=4)
        assert rows["CP"]["messages"] == 4 * one["messages"] == 4 * (3 * 4 - 2)
        assert rows["CP"]["NVLink"] == pytest.approx(4 * one["seconds"])
        assert "3N−2" in rows["CP"]["how_often"]
    text = str(gc.parallelism_axes())
    assert all(a in text for a in ("DP/ZeRO-3", "TP", "PP", "CP", "EP"))
    with pytest.raises(ValueError):
        gc.parallelism_axes(top_k=9)


def test_load_balancing_loss_keeps_the_router_from_collapsing():
    runs = {w: gc.load_balance_run(w, steps=60) for w in (0.0, 0.1)}
    for run in runs.values():
        assert (run["counts"].sum(1) == 256 * 2).all()
    imbalance = {w: (r["counts"][-10:].float().max(1).values / 64).mean().item() for w, r in runs.items()}
    assert imbalance[0.0] > 2.5 and imbalance[0.1] < 1.8, imbalance
    assert runs[0.1]["aux_loss"][-1] < runs[0.0]["aux_loss"][-1]
