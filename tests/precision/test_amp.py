"""AMP training step (plain and with DDP), autocast inside forward, the op table, op timing."""

import copy
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gpucourse as gc


def _setup(seed=0, sizes=(8, 32, 4)):
    torch.manual_seed(seed)
    model = gc.MLP(*sizes)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _batches(seed, n, batch=16, sizes=(8, 4)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, sizes[0], generator=g), torch.randn(batch, sizes[1], generator=g)) for _ in range(n)]


def _recipe(model, opt, scaler, x, y, dtype, max_norm):
    """The documented torch.amp recipe, written out: the oracle for amp_step."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = F.mse_loss(model(x), y)
    if scaler is None:
        loss.backward()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        return
    scaler.scale(loss).backward()
    if max_norm:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("dtype, use_scaler, max_norm", [
    (torch.bfloat16, False, None), (torch.bfloat16, True, 0.5), (torch.float16, True, None),
    (torch.float16, True, 0.3), (None, False, 1.0), (None, True, None),
])
def test_amp_step_equals_the_torch_recipe(dtype, use_scaler, max_norm):
    ma, oa = _setup()
    mb = copy.deepcopy(ma)
    ob = torch.optim.SGD(mb.parameters(), lr=0.1, momentum=0.9)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2) if use_scaler else None
    our_scaler = gc.LossScaler(init_scale=2.0**20, growth_interval=2) if use_scaler else None
    for x, y in _batches(1, 6):
        _recipe(ma, oa, ref_scaler, x, y, dtype, max_norm)
        r = gc.amp_step(mb, ob, x, y, F.mse_loss, dtype=dtype, scaler=our_scaler, max_grad_norm=max_norm)
        assert (r.grad_norm is None) == (max_norm is None)
        if use_scaler:
            assert our_scaler.get_scale() == ref_scaler.get_scale()
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(pa, pb)
        assert pb.dtype == torch.float32 and pb.grad.dtype == torch.float32      # fp32 master weights


def test_amp_step_reports_skipped_steps_and_loss():
    model, opt = _setup()
    scaler = gc.LossScaler(init_scale=2.0**30)        # far too large for fp16: the first steps overflow
    results = [gc.amp_step(model, opt, x, y, F.mse_loss, dtype=torch.float16, scaler=scaler)
               for x, y in _batches(2, 40)]
    assert results[0].skipped and results[0].scale == 2.0**30
    assert not results[-1].skipped
    assert sum(r.skipped for r in results) == sum(1 for a, b in zip(results, results[1:]) if b.scale < a.scale)
    assert all(r.loss == r.loss for r in results)     # the unscaled loss is reported, not inf


def test_amp_step_bf16_trains_about_as_well_as_fp32():
    losses = {}
    for dtype in (None, torch.bfloat16):
        model, opt = _setup(3)
        data = _batches(4, 1, batch=64)[0]
        for _ in range(60):
            r = gc.amp_step(model, opt, *data, F.mse_loss, dtype=dtype)
        losses[dtype] = r.loss
    assert losses[torch.bfloat16] < 0.5 * F.mse_loss(torch.zeros(64, 4), data[1]).item()
    assert losses[torch.bfloat16] == pytest.approx(losses[None], rel=0.2, abs=0.02)


def test_amp_step_argument_checks():
    model, opt = _setup()
    x, y = _batches(0, 1)[0]
    with pytest.raises(ValueError, match="dtype must be"):
        gc.amp_step(model, opt, x, y, F.mse_loss, dtype=torch.float64)
    with pytest.raises(ValueError, match="device_type must be"):
        gc.amp_step(model, opt, x, y, F.mse_loss, device_type="tpu")
    with pytest.raises(ValueError, match="max_grad_norm"):
        gc.amp_step(model, opt, x, y, F.mse_loss, max_grad_norm=0)
    with pytest.warns(UserWarning, match="LossScaler"):
        gc.amp_step(model, opt, x, y, F.mse_loss, dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gc.amp_step(model, opt, x, y, F.mse_loss, dtype=torch.bfloat16)      # bf16 needs no scaler


# --- AMP with DDP ------------------------------------------------------------------------------

def _ddp_amp_worker(rank, world_size, dtype, steps, poison_rank):
    model, _ = _setup(0)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    scaler = gc.LossScaler(init_scale=2.0**12, growth_interval=3)
    skipped, scales = [], []
    for step, (x, y) in enumerate(_batches(5, steps, batch=16)):
        x = x.chunk(world_size)[rank]                 # each rank: its share of the global batch
        y = y.chunk(world_size)[rank]
        if step == 2 and rank == poison_rank:
            x = x.clone()
            x[0, 0] = float("inf")                    # a bad sample on one rank only
        r = gc.amp_step(ddp, opt, x, y, F.mse_loss, dtype=dtype, scaler=scaler, max_grad_norm=5.0)
        skipped.append(r.skipped)
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in model.parameters()], skipped, scales


def test_ddp_amp_ranks_agree_and_match_one_process():
    steps = 5
    results = gc.launch(_ddp_amp_worker, 2, args=(torch.bfloat16, steps, -1), timeout=120)
    # every rank holds the same parameters and the same scaler state
    for pa, pb in zip(results[0][0], results[1][0]):
        assert torch.equal(pa, pb)
    assert results[0][2] == results[1][2]
    # one process on the whole batch with the same recipe: equal up to bf16 rounding
    model, opt = _setup(0)
    scaler = gc.LossScaler(init_scale=2.0**12, growth_interval=3)
    scales = []
    for x, y in _batches(5, steps, batch=16):
        gc.amp_step(model, opt, x, y, F.mse_loss, dtype=torch.bfloat16, scaler=scaler, max_grad_norm=5.0)
        scales.append(scaler.get_scale())
    for p_ddp, p_one in zip(results[0][0], model.parameters()):
        torch.testing.assert_close(p_ddp, p_one.detach(), atol=2e-2, rtol=2e-2)
    assert results[0][2] == scales


def test_ddp_amp_an_overflow_on_one_rank_is_skipped_by_all():
    results = gc.launch(_ddp_amp_worker, 2, args=(torch.bfloat16, 4, 1), timeout=120)
    (p0, skipped0, scales0), (p1, skipped1, scales1) = results
    assert skipped0 == skipped1 == [False, False, True, False]       # the all-reduce spread the inf
    assert scales0 == scales1 and scales0[2] == scales0[1] / 2
    for a, b in zip(p0, p1):
        assert torch.equal(a, b) and torch.isfinite(a).all()


# --- autocast inside forward, the op table -----------------------------------------------------

def test_autocast_module_works_in_other_threads():
    torch.manual_seed(0)
    inner = gc.MLP(4, 8, 2)
    wrapped = gc.AutocastModule(inner, "cpu", torch.bfloat16)
    x = torch.randn(3, 4)
    seen = {}

    def replica(module, key):
        seen[key] = module(x)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = inner(x)
        for module, key in ((inner, "outside"), (wrapped, "inside")):
            t = threading.Thread(target=replica, args=(module, key))
            t.start()
            t.join()
    assert seen["outside"].dtype == torch.float32                     # autocast is thread-local
    assert seen["inside"].dtype == torch.bfloat16
    assert torch.equal(seen["inside"], expected)
    seen["inside"].float().sum().backward()
    assert inner[0].weight.grad.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        gc.AutocastModule(inner, "cpu", torch.float32)


def test_autocast_op_dtypes_reports_what_autocast_did():
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    labels = torch.randint(0, 4, (8,))

    def fn():
        h = F.linear(x, w)
        return F.cross_entropy(torch.relu(h), labels)

    records = gc.autocast_op_dtypes(fn)
    assert [(r.name, r.output_dtype, r.kind) for r in records] == [
        ("linear", torch.bfloat16, "lower precision"),
        ("relu", torch.bfloat16, "follows inputs"),
        ("cross_entropy", torch.float32, "fp32"),
    ]
    with torch.autocast("cpu", dtype=torch.bfloat16):        # the oracle: autocast itself
        assert F.linear(x, w).dtype == records[0].output_dtype
    table = gc.format_op_table(records)
    assert "linear" in table and "lower precision" in table
    fp16 = gc.autocast_op_dtypes(fn, dtype=torch.float16)
    assert fp16[0].output_dtype == torch.float16


# --- speed helpers (correctness only: timings are never asserted) ------------------------------

def test_op_time_shares_sees_forward_backward_and_casts():
    torch.manual_seed(0)
    model = gc.MLP(16, 32, 16)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    fp32 = gc.op_time_shares(gc.training_step(model, x, y))
    bf16 = gc.op_time_shares(gc.training_step(model, x, y, dtype=torch.bfloat16))
    assert {"addmm", "mm"} <= set(fp32.per_op)          # forward and backward matmuls
    assert "_to_copy" in bf16.per_op and "_to_copy" not in fp32.per_op
    for t in (fp32, bf16):
        assert sum(t.share(k) for k in ("matmul", "cast", "other")) == pytest.approx(1.0)
    assert "matmul" in str(fp32)
    with pytest.raises(ValueError, match="kind"):
        fp32.share("gemm")


def test_training_step_and_elementwise_net():
    torch.manual_seed(0)
    net = gc.ElementwiseNet(width=8, depth=2, ops=1)
    x = torch.randn(32, 8)
    step = gc.training_step(net, x, torch.zeros(32, 8), dtype=torch.bfloat16, lr=0.05)
    losses = [step() for _ in range(20)]
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="width"):
        gc.ElementwiseNet(width=0)
    scaler = gc.LossScaler(init_scale=2.0**8)
    step16 = gc.training_step(gc.MLP(8, 8), x, x, dtype=torch.float16, scaler=scaler)
    step16()
    assert scaler.get_scale() == 2.0**8


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_amp_step_equals_recipe(dtype):
    ma, oa = _setup()
    ma = ma.cuda()
    oa = torch.optim.SGD(ma.parameters(), lr=0.1)
    mb = copy.deepcopy(ma)
    ob = torch.optim.SGD(mb.parameters(), lr=0.1)
    sa, sb = torch.amp.GradScaler("cuda"), gc.LossScaler()
    for x, y in _batches(1, 4):
        x, y = x.cuda(), y.cuda()
        oa.zero_grad()
        with torch.autocast("cuda", dtype=dtype):
            loss = F.mse_loss(ma(x), y)
        sa.scale(loss).backward()
        sa.step(oa)
        sa.update()
        gc.amp_step(mb, ob, x, y, F.mse_loss, dtype=dtype, scaler=sb)
    assert sa.get_scale() == sb.get_scale()
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(pa, pb)


def test_compare_precisions_and_plot():
    import matplotlib
    matplotlib.use("Agg")
    runs = gc.compare_precisions(lambda: gc.MLP(16, 16), 8, 16, dtypes=(None, torch.bfloat16, torch.float16),
                                 repeats=2, warmup=1, name="tiny")
    assert [r.timing.name for r in runs] == ["tiny fp32 (cpu)", "tiny bf16 (cpu)", "tiny fp16 (cpu)"]
    assert [r.dtype for r in runs] == [None, torch.bfloat16, torch.float16]
    assert all(len(r.timing.times) == 2 and r.split.total > 0 for r in runs)
    ax = gc.plot_time_split(runs)
    assert len(ax.patches) == 3 * len(runs)
    with pytest.raises(ValueError, match="dtypes may contain"):
        gc.compare_precisions(lambda: gc.MLP(4, 4), 2, 4, dtypes=(torch.float64,))
    with pytest.raises(ValueError, match="kind"):
        runs[0].split.seconds("flops")


def test_autocast_dtype_is_thread_local_too():
    """What torch.nn.DataParallel's workers do — re-enter autocast with only `enabled` — loses the dtype."""
    seen = {}

    def worker(enabled):
        with torch.amp.autocast("cpu", enabled=enabled):
            seen["dtype"] = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype

    with torch.autocast("cpu", dtype=torch.float16):
        t = threading.Thread(target=worker, args=(torch.is_autocast_enabled("cpu"),))
        t.start()
        t.join()
    assert seen["dtype"] == torch.bfloat16            # the CPU default, not the caller's fp16


@pytest.mark.multigpu
def test_torch_data_parallel_replicas_and_autocast_module():
    model = gc.MLP(8, 16, 4).cuda()
    x = torch.randn(8, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        plain = torch.nn.DataParallel(model)(x)
        inside = torch.nn.DataParallel(gc.AutocastModule(model, "cuda", torch.bfloat16))(x)
    assert plain.dtype == torch.float16               # only on/off reached the replicas
    assert inside.dtype == torch.bfloat16
