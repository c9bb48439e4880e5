"""The planner's formulas against the real thing: TinyGPT's parameters, FLOPs counted by torch,
activation bytes held by a real forward, chapter 08's ZeRO table, chapter 05's α-β model."""

import inspect

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import gpucourse as gc


def _tiny(seed, **kw):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))          # noqa: E731
    heads = r(1, 4)
    cfg = dict(vocab_size=r(5, 40), seq_len=r(4, 20), num_layers=r(1, 4), hidden=heads * r(2, 9),
               num_heads=heads, ffn_hidden=r(3, 50))
    cfg.update(kw)
    return gc.TinyGPT(**cfg)


@pytest.mark.parametrize("seed", range(4))
def test_from_module_counts_tinygpt_params_and_flops(seed):
    net = _tiny(seed)
    seq = net.config["seq_len"] - seed % 2                       # also a shorter sequence than the table
    spec = gc.ModelSpec.from_module(net, seq)
    assert spec.num_params() == net.num_parameters() == sum(p.numel() for p in net.parameters())
    idx = torch.randint(0, net.config["vocab_size"], (3, seq))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:   # the math path: bmm, counted
        net.loss(idx, idx).backward()
    assert spec.flops_per_token() * idx.numel() == counter.get_total_flops()


def test_presets_match_published_sizes():
    sizes = {n: gc.ModelSpec.preset(n).num_params() / 1e9 for n in gc.ModelSpec.preset_names()}
    for name, published in (("llama3-8b", 8.03), ("llama3-70b", 70.6), ("llama3-405b", 405.0),
                            ("gpt3-175b", 175.0), ("mixtral-8x7b", 46.7)):
        assert abs(sizes[name] - published) / published < 0.01, (name, sizes[name])
    mix = gc.ModelSpec.preset("mixtral-8x7b")
    assert abs(mix.num_active_params() / 1e9 - 12.9) < 0.1
    assert gc.ModelSpec.preset("llama3-8b", seq=4096).seq == 4096
    with pytest.raises(ValueError, match="llama3-8b"):
        gc.ModelSpec.preset("llama-9b")


def _count_live_forward(net, idx, recompute):
    if recompute == "full":
        for block in net.blocks:
            inner = block.forward
            block.forward = lambda x, inner=inner: checkpoint(inner, x, use_reentrant=False)
    with gc.MemoryTracker(["cpu:0"]) as tracker:
        loss = net.loss(idx, idx)
        live = tracker.live()["cpu:0"]
    loss.backward()
    return live


@pytest.mark.parametrize("seed,recompute", [(0, "none"), (1, "none"), (2, "full"), (3, "none")])
def test_activation_bytes_equal_what_a_real_forward_keeps(seed, recompute):
    net = _tiny(seed)
    spec = gc.ModelSpec.from_module(net)
    b = 2 + seed
    idx = torch.randint(0, spec.vocab, (b, spec.seq))
    live = _count_live_forward(net, idx, recompute)
    predicted = (spec.layers * gc.layer_activation_bytes(spec, micro_batch=b, dtype_bytes=4, recompute=recompute)
                 + gc.outside_activation_bytes(spec, micro_batch=b, dtype_bytes=4))
    # the tracker sees new storages only: the batch of ids existed before the forward
    assert predicted - idx.numel() * 8 == live


def test_terms_reproduce_korthikanti_closed_forms():
    m = gc.ModelSpec.preset("gpt3-175b")
    for t, sp, rc in [(1, False, "none"), (8, False, "none"), (8, True, "none"), (8, True, "selective"),
                      (8, True, "full"), (4, False, "full")]:
        terms = gc.activation_terms(m, micro_batch=1, tp=t, sequence_parallel=sp, recompute=rc, attention="eager",
                                    dropout=True)
        ours = sum(v for name, v in terms if "statistics" not in name)       # the paper omits norm statistics
        paper = gc.korthikanti_layer_bytes(m.seq, 1, m.hidden, m.heads, t, sequence_parallel=sp, recompute=rc)
        assert ours == pytest.approx(paper, rel=1e-9), (t, sp, rc)
    flash = gc.layer_activation_bytes(m, micro_batch=1, tp=8, sequence_parallel=True)
    assert flash < gc.korthikanti_layer_bytes(m.seq, 1, m.hidden, m.heads, 8, sequence_parallel=True) / 2


def test_model_states_are_chapter_08s_zero_memory():
    for psi, n, stage in [(1000, 4, 0), (12345, 3, 1), (777, 8, 2), (10 ** 6, 5, 3)]:
        parts = gc.model_state_bytes(psi, n, stage)
        assert abs(sum(parts.values()) - gc.zero_memory(psi, n, stage)) <= 3
        fp32 = gc.model_state_bytes(psi, n, stage, "fp32")
        assert fp32["params"] == 2 * parts["params"] and fp32["grads"] == 2 * parts["grads"]


def test_stage_params_cover_the_model_once():
    for name in ("llama3-8b", "gpt3-175b", "mixtral-8x7b"):
        m = gc.ModelSpec.preset(name)
        stages = gc.stage_params(m, gc.ParallelConfig(pp=4))
        copies = m.outside_param_groups()["embedding"] if m.tied_embeddings else 0      # the last stage's head copy
        assert sum(s["dense"] + s["expert"] for s in stages) == m.num_params() + copies
    m = gc.ModelSpec.preset("mixtral-8x7b")
    full = gc.stage_params(m, gc.ParallelConfig())[0]["expert"]
    assert gc.stage_params(m, gc.ParallelConfig(ep=4))[0]["expert"] * 4 == full


def test_predict_terms_are_the_named_formulas():
    m = gc.ModelSpec(layers=4, hidden=256, heads=8, ffn=1024, vocab=1000, seq=128)
    c = gc.ClusterSpec(1, 8, 8e9, 1e12, intra=(1e-5, 1e9), inter=(1e-4, 1e8))
    one = gc.predict(m, gc.ClusterSpec(1, 1, 8e9, 1e12), gc.ParallelConfig(), global_batch=8, overlap=False)
    assert one.time.total == pytest.approx(one.time.compute) and one.mfu == pytest.approx(1.0)
    assert one.time.compute == pytest.approx(8 * 128 * m.flops_per_token() / 1e12)
    p = gc.predict(m, c, gc.ParallelConfig(dp=8), global_batch=8, overlap=False)
    grad_bytes = m.num_params() * 2
    assert p.time.dp == pytest.approx(gc.zero_comm_time(grad_bytes, 8, 0, 1e-5, 1e-9))
    assert p.time.compute == pytest.approx(one.time.compute / 8)
    pp = [gc.predict(m, c, gc.ParallelConfig(dp=2, pp=4, microbatches=k), global_batch=8) for k in (1, 2, 4)]
    assert pp[0].time.bubble > pp[1].time.bubble > pp[2].time.bubble > 0
    two = [gc.predict(m, c, gc.ParallelConfig(dp=4, pp=2, microbatches=k), global_batch=8).memory.stages[0]
           for k in (1, 2)]                                  # 1F1B: stage 0 holds min(m, pp) micro-batches
    assert two[0]["activations"] == pytest.approx(two[1]["activations"], rel=1e-3)   # 1 × 2 seqs = 2 × 1
    assert pp[2].memory.stages[0]["activations"] == pytest.approx(pp[0].memory.stages[0]["activations"], rel=1e-3)
    rc = {r: gc.predict(m, c, gc.ParallelConfig(dp=8, recompute=r), global_batch=8) for r in ("none", "full")}
    assert rc["full"].memory.activations < rc["none"].memory.activations
    assert rc["full"].time.compute > rc["none"].time.compute and rc["full"].mfu < rc["none"].mfu
    z = [gc.predict(m, c, gc.ParallelConfig(dp=8, zero=s), global_batch=8).memory for s in range(4)]
    assert z[0].optimizer > z[1].optimizer and z[1].grads > z[2].grads and z[2].params > z[3].params
    tp = gc.predict(m, c, gc.ParallelConfig(dp=4, tp=2), global_batch=8)
    assert tp.time.tp == pytest.approx(gc.tp_comm_time(2, 128, 256, 4, 2, c.intra, 2))


def test_predict_rejects_bad_splits_with_reasons():
    m = gc.ModelSpec(layers=3, hidden=96, heads=6, ffn=384, vocab=100, seq=64)
    c = gc.ClusterSpec(1, 4, 8e9, 1e12)
    for cfg, words in [(gc.ParallelConfig(pp=4), "layers=3"), (gc.ParallelConfig(tp=4), "heads=6"),
                       (gc.ParallelConfig(dp=2, ep=2), "no experts"), (gc.ParallelConfig(dp=2), "devices"),
                       (gc.ParallelConfig(dp=4, microbatches=3), "microbatches=3")]:
        with pytest.raises(ValueError, match=words):
            gc.predict(m, c, cfg, global_batch=8)
    with pytest.raises(TypeError):
        gc.predict(m, c, gc.ParallelConfig(dp=4), global_batch=8.0)
    with pytest.raises(ValueError, match="recompute"):
        gc.ParallelConfig(recompute="some")
    with pytest.raises(ValueError, match="hidden"):
        gc.ModelSpec(layers=1, hidden=10, heads=3, ffn=4, vocab=4, seq=4)


def test_plan_ranks_valid_configurations_and_explains_rejections():
    m = gc.ModelSpec(layers=4, hidden=256, heads=8, ffn=1024, vocab=1000, seq=128, experts=4, top_k=2)
    c = gc.ClusterSpec(2, 4, 0.05e9, 1e12, intra=(1e-5, 1e10), inter=(1e-4, 1e8))
    p = gc.plan(m, c, global_batch=16, top=5)
    assert 0 < len(p) <= 5 and p.considered == len(p._all) + len(p.rejected)
    times = [q.time.total for q in p._all]
    assert times == sorted(times) and all(q.fits for q in p._all)
    for q in p.ranked:                                           # the planner's numbers are predict's
        again = gc.predict(m, c, q.config, global_batch=16)
        assert again.time.total == q.time.total and again.memory.total == q.memory.total
    reasons = " | ".join(why for _, why in p.rejected)
    assert "does not fit" in reasons and "does not divide" in reasons
    assert p.rank_of(p.best().config) == 1
    dense = gc.plan(gc.ModelSpec(layers=2, hidden=64, heads=4, ffn=256, vocab=64, seq=32),
                    gc.ClusterSpec(1, 2, 1e9, 1e9), global_batch=4)
    assert any("no experts" in why for _, why in dense.rejected)


def test_cluster_presets_and_links():
    h = gc.ClusterSpec.preset("h100-sxm-8", nodes=4)
    assert h.devices == 32 and h.peak_flops == 989e12
    assert h.link_for(1, 8) is h.intra and h.link_for(8, 4) is h.inter and h.link_for(2, 8) is h.inter
    e = gc.ClusterSpec.preset("1gbe", nodes=4)
    assert e.inter == gc.LINKS["1 GbE"].__class__(e.inter.alpha, e.inter.beta, "inter")
    assert e.inter.beta == pytest.approx(gc.LINKS["1 GbE"].beta)
    # one consumer GPU per machine: nothing crosses intra, and it is no NVLink (PCIe 4.0 at most)
    assert e.devices_per_node == 1 and e.intra.bandwidth <= 32e9 and e.memory_bytes == 24 * 2**30
    with pytest.raises(TypeError, match="intra"):
        gc.ClusterSpec(1, 1, 1e9, 1e9, intra=5)


def test_planner_counts_bytes_with_chapter_11s_own_functions():
    from gpucourse.planning import communication
    assert communication.cp_comm_bytes is gc.cp_comm_bytes
    assert communication.ep_comm_bytes is gc.ep_comm_bytes
    params = inspect.signature(gc.ep_comm_bytes).parameters
    assert {"tokens", "d_model", "world_size", "top_k", "dtype_bytes", "send_counts"} <= set(params)
    assert all(p.kind is p.KEYWORD_ONLY for p in params.values())
    out = communication.ep_comm_bytes(tokens=10, d_model=8, world_size=2, top_k=2)
    assert out["total"] == out["forward"] + out["backward"] > 0




def test_capacity_factor_bounds_the_busiest_expert_rank():
    base = dict(layers=2, hidden=128, heads=4, ffn=512, vocab=256, seq=64, experts=4, top_k=2)
    c = gc.ClusterSpec(1, 4, 8e9, 1e12, intra=(1e-5, 1e9), inter=(1e-4, 1e8))
    cfg = gc.ParallelConfig(ep=4)
    free, capped = gc.ModelSpec(**base), gc.ModelSpec(**base, capacity_factor=1.5)
    assert (free.expert_load(4), capped.expert_load(4), capped.expert_load(1)) == (1.0, 1.5, 1.0)
    assert gc.ModelSpec(**{**base, "experts": 2, "top_k": 1}, capacity_factor=3.0).expert_load(2) == 2.0   # all tokens
    p, q = (gc.predict(m, c, cfg, global_batch=8, overlap=False) for m in (free, capped))
    tokens = 8 * 64 / 4                                                     # per rank
    extra = 0.5 * tokens * 6 * 2 * (2 * 128 * 512) * 2                     # (load−1)·tokens·6·k·(2hf)·L
    assert q.time.compute - p.time.compute == pytest.approx(extra / 1e12)
    nbytes = gc.ep_comm_bytes(tokens=2 * 64, d_model=128, world_size=4, top_k=2, dtype_bytes=2)["total"]
    assert p.time.ep == pytest.approx(2 * (4 * 3 * 1e-5 + nbytes * 1e-9))  # 2 layers: 12 messages + bytes
    assert q.time.ep - p.time.ep == pytest.approx(2 * 0.5 * nbytes * 1e-9)  # the busiest rank gets 1.5× the bytes
    assert q.mfu < p.mfu                                                   # model FLOPs unchanged, the step longer
    with pytest.raises(ValueError, match="capacity_factor"):
        gc.ModelSpec(**base, capacity_factor=0)
    with pytest.raises(TypeError, match="capacity_factor"):
        gc.ModelSpec(**base, capacity_factor="1.25")


def test_without_overlap_ring_attention_traffic_counts_whole():
    m = gc.ModelSpec(layers=2, hidden=256, heads=8, ffn=1024, vocab=256, seq=4096)
    c = gc.ClusterSpec(1, 2, 8e9, 1e12, intra=(1e-5, 1e9), inter=(1e-4, 1e8))
    hidden, whole = (gc.predict(m, c, gc.ParallelConfig(cp=2), global_batch=2, overlap=o).time.cp for o in (True, False))
    nbytes = gc.cp_comm_bytes(batch=2, heads=8, seq=4096, head_dim=32, world_size=2, method="ring", causal=True,
                              dtype_bytes=2)["total"]
    assert whole == pytest.approx(2 * (3 * 1e-5 + nbytes * 1e-9))         # 2 layers, no compute subtracted
    assert 0 <= hidden < whole


def test_the_busiest_expert_rank_keeps_load_times_the_experts_activations():
    base = dict(layers=2, hidden=128, heads=4, ffn=512, vocab=256, seq=64, experts=4, top_k=2)
    free, capped = gc.ModelSpec(**base), gc.ModelSpec(**base, capacity_factor=1.5)
    even = dict(gc.activation_terms(free, micro_batch=2, dtype_bytes=4))
    busy = dict(gc.activation_terms(free, micro_batch=2, dtype_bytes=4, expert_load=1.5))
    received = {"expert inputs (dispatched tokens)", "fc1 output (activation input)", "fc2 input (activation output)"}
    for name in even:                                  # the experts' tensors grow, the rank's own do not
        assert busy[name] == (even[name] * 3 // 2 if name in received else even[name]), name
    c = gc.ClusterSpec(1, 4, 8e9, 1e12)
    p, q = (gc.predict(m, c, gc.ParallelConfig(ep=4), global_batch=8).memory for m in (free, capped))
    even16, busy16 = (dict(gc.activation_terms(free, micro_batch=2, expert_load=x)) for x in (1.0, 1.5))   # bf16
    assert q.activations - p.activations == 2 * sum(busy16[n] - even16[n] for n in received)   # 2 layers
    assert (q.params, q.optimizer) == (p.params, p.optimizer)
    with pytest.raises(ValueError, match="expert_load"):
        gc.activation_terms(free, micro_batch=2, expert_load=0)
