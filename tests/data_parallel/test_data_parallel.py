"""DataParallel and BalancedDataParallel: the single-device step (and torch.nn.DataParallel on GPUs) are the oracles."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import gpucourse as gc
from gpucourse.data_parallel.device_workers import current_device_index


def _devs(n):
    return [torch.device("cpu", i) for i in range(n)]


def _compare_step(model, inputs, n_devices, *, make=None, kwargs=None, loss=lambda o: o.square().sum()):
    """Forward + backward with DataParallel and on one device; outputs and gradients must agree."""
    kwargs = kwargs or {}
    single = copy.deepcopy(model)
    inputs_a = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    inputs_b = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    dp = (make or gc.DataParallel)(model, device_ids=_devs(n_devices))
    out_dp = dp(*inputs_a, **kwargs)
    out_1 = single(*inputs_b, **kwargs)
    torch.testing.assert_close(out_dp, out_1, atol=1e-5, rtol=1e-4)
    loss(out_dp).backward()
    loss(out_1).backward()
    for (name, p), q in zip(model.named_parameters(), single.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=f"gradient of {name}")
    for a, b in zip(inputs_a, inputs_b):
        if a.requires_grad:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)


@settings(deadline=None, max_examples=20)
@given(batch=st.integers(1, 11), n_devices=st.integers(1, 4), seed=st.integers(0, 1000))
def test_same_outputs_and_gradients_as_one_device(batch, n_devices, seed):
    torch.manual_seed(seed)
    _compare_step(gc.MLP(6, 9, 3), [torch.randn(batch, 6)], n_devices)


def test_conv_net_with_cross_entropy():
    torch.manual_seed(0)
    x, y = torch.randn(10, 3, 32, 32), torch.randint(0, 10, (10,))
    _compare_step(gc.Net(), [x], 3, loss=lambda o: F.cross_entropy(o, y))


def test_batch_dim_1_keyword_arguments_and_structured_outputs():
    class Structured(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, *, scale):               # x: (T, B, 4), batch on dim 1
            h = self.lin(x) * scale
            return {"h": h, "pair": (h.relu(), h.sum(-1))}

    torch.manual_seed(1)
    model = Structured()
    x = torch.randn(3, 7, 4)
    scale = torch.rand(1, 7, 1)                        # scattered along dim 1 too
    single = copy.deepcopy(model)
    dp = gc.DataParallel(model, device_ids=_devs(3), dim=1)
    out = dp(x, scale=scale)
    ref = single(x, scale=scale)
    torch.testing.assert_close(out["h"], ref["h"])
    torch.testing.assert_close(out["pair"][1], ref["pair"][1])
    (out["pair"][0].sum() + out["pair"][1].square().sum()).backward()
    (ref["pair"][0].sum() + ref["pair"][1].square().sum()).backward()
    torch.testing.assert_close(model.lin.weight.grad, single.lin.weight.grad)


def test_output_device_and_replicas_on_their_devices():
    class WhereAmI(nn.Module):
        def forward(self, x):
            return torch.full((x.shape[0],), current_device_index())

    dp = gc.DataParallel(WhereAmI(), device_ids=_devs(3), output_device="cpu:2")
    assert dp(torch.zeros(6, 1)).tolist() == [0, 0, 1, 1, 2, 2]
    assert dp.output_device == torch.device("cpu", 2)


def test_training_with_an_optimizer_matches_one_device():
    torch.manual_seed(0)
    model = gc.MLP(5, 8, 2)
    single = copy.deepcopy(model)
    dp = gc.DataParallel(model, device_ids=_devs(2))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, single)]
    for step in range(5):
        x, y = torch.randn(9, 5), torch.randint(0, 2, (9,))
        for net, opt in ((dp, opts[0]), (single, opts[1])):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    for p, q in zip(model.parameters(), single.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


class _CheckpointedMLP(nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(6, 9), nn.Linear(9, 9), nn.Linear(9, 3)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = torch.tanh(self.first(x))
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.middle(t)), h,
                                              use_reentrant=self.use_reentrant)
        return self.last(h)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_inside_the_replicas(use_reentrant):
    """torch.nn.DataParallel takes a model with checkpointed layers. The replicas' backward ran
    torch.autograd.grad, which a reentrant checkpoint refuses ("incompatible with .grad()"), so
    use_reentrant=True raised torch's message about a call the learner never made."""
    torch.manual_seed(1)
    _compare_step(_CheckpointedMLP(use_reentrant), [torch.randn(10, 6)], 3)


def test_batchnorm_per_chunk_statistics_and_only_replica_0_updates_buffers():
    torch.manual_seed(0)
    model = nn.BatchNorm1d(3)
    x = torch.randn(8, 3) * 3 + 1
    dp = gc.DataParallel(model, device_ids=_devs(2))
    out = dp(x)
    chunk_models = [copy.deepcopy(nn.BatchNorm1d(3)) for _ in range(2)]
    expected = torch.cat([m(c) for m, c in zip(chunk_models, x.chunk(2))])
    torch.testing.assert_close(out, expected)                     # each chunk normalised by itself
    torch.testing.assert_close(model.running_mean, chunk_models[0].running_mean)   # replica 0 only
    assert model.num_batches_tracked.item() == 1
    model.eval()
    torch.testing.assert_close(dp(x), model(x))                  # eval: same as the whole batch


def test_autocast_around_the_call_and_inside_forward():
    class CastInside(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.lin(x)

    x = torch.randn(4, 4)
    assert gc.DataParallel(CastInside(), device_ids=_devs(2))(x).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):              # propagated into the workers
        assert gc.DataParallel(nn.Linear(4, 4), device_ids=_devs(2))(x).dtype == torch.bfloat16


def test_forward_without_arguments_runs_once():
    class Constant(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self):
            return self.w * 2

    assert gc.DataParallel(Constant(), device_ids=_devs(2))().tolist() == [2.0, 2.0]


def test_state_dict_has_the_module_prefix_and_loads_into_the_bare_model():
    model = gc.ToyModel()
    dp = gc.DataParallel(model, device_ids=_devs(2))
    keys = list(dp.state_dict())
    assert all(k.startswith("module.") for k in keys)
    bare = gc.ToyModel()
    bare.load_state_dict({k.removeprefix("module."): v for k, v in dp.state_dict().items()})
    torch.testing.assert_close(bare.net1.weight, model.net1.weight)


@pytest.mark.parametrize("device_ids, error, match", [
    ([], ValueError, "empty"),
    (["cpu:0", "cpu:0"], ValueError, "twice"),
    (["cpu:0", "mps:0"], ValueError, "only 'cuda' devices"),
    (["cuda:7"], ValueError, "does not exist"),
    ("cpu:0", TypeError, "list of devices"),
])
def test_bad_device_ids(device_ids, error, match):
    if match == "does not exist" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    with pytest.raises(error, match=match):
        gc.DataParallel(nn.Linear(2, 2), device_ids=device_ids)


def test_module_not_on_the_cpu_for_virtual_devices():
    dp = gc.DataParallel(nn.Linear(2, 2, device="meta"), device_ids=_devs(2))
    with pytest.raises(RuntimeError, match="model.cpu"):
        dp(torch.zeros(2, 2))


def test_default_device_ids():
    dp = gc.DataParallel(nn.Linear(2, 2))
    expected = torch.cuda.device_count() if torch.cuda.is_available() else gc.cpu_cores()
    assert len(dp.device_ids) == expected


# --- BalancedDataParallel -----------------------------------------------------------------------

@given(st.integers(1, 300), st.data(), st.integers(2, 8))
def test_balanced_chunk_sizes_invariants(batch, data, n):
    gpu0 = data.draw(st.integers(0, batch))
    sizes = gc.balanced_chunk_sizes(batch, gpu0, n)
    assert len(sizes) == n and sum(sizes) == batch and sizes[0] == gpu0
    assert max(sizes[1:]) - min(sizes[1:]) <= 1 and sizes[1:] == sorted(sizes[1:], reverse=True)


@settings(max_examples=300)
@given(st.integers(1, 2**70), st.data(), st.integers(1, 5000))
def test_balanced_chunk_sizes_is_integer_exact(batch, data, n):
    """Far beyond float64's 2**53: device 0 gets gpu0_bsz, the first (rest % (n-1)) others one more."""
    gpu0 = batch if n == 1 else data.draw(st.one_of(st.integers(0, batch), st.sampled_from([0, batch])))
    sizes = gc.balanced_chunk_sizes(batch, gpu0, n)
    assert all(type(s) is int and s >= 0 for s in sizes) and len(sizes) == n
    assert sizes[0] == gpu0 and sum(sizes) == batch
    if n > 1:
        base, extra = divmod(batch - gpu0, n - 1)
        assert sizes[1:] == [base + 1] * extra + [base] * (n - 1 - extra)


@pytest.mark.parametrize("args, expected", [
    ((8, 2, 3), [2, 3, 3]), ((16, 4, 3), [4, 6, 6]), ((8, 0, 3), [0, 4, 4]),
    ((8, 8, 3), [8, 0, 0]), ((5, 5, 1), [5]),
])
def test_balanced_chunk_sizes_examples(args, expected):
    assert gc.balanced_chunk_sizes(*args) == expected


@pytest.mark.parametrize("args, error, match", [
    ((8, -1, 3), ValueError, r"gpu0_bsz must be in \[0, 8\]"),
    ((8, 9, 3), ValueError, r"gpu0_bsz must be in \[0, 8\]"),
    ((0, 0, 3), ValueError, "batch_size must be >= 1"),
    ((8, 2, 0), ValueError, "num_devices must be >= 1"),
    ((8, 2, 1), ValueError, "with 1 device"),
    ((8, 2.0, 3), TypeError, "gpu0_bsz must be an int"),
])
def test_balanced_chunk_sizes_errors(args, error, match):
    with pytest.raises(error, match=match):
        gc.balanced_chunk_sizes(*args)


def test_balanced_data_parallel_scatter_and_equivalence():
    torch.manual_seed(0)
    model = gc.MLP(4, 6, 2)
    bdp = gc.BalancedDataParallel(2, model, device_ids=_devs(3))
    args, _, used = bdp.scatter((torch.randn(8, 4),), {}, bdp.device_ids)
    assert [a[0].shape[0] for a in args] == [2, 3, 3] and used == _devs(3)
    _compare_step(gc.MLP(4, 6, 2), [torch.randn(8, 4)], 3,
                  make=lambda m, device_ids: gc.BalancedDataParallel(2, m, device_ids=device_ids))


def test_gpu0_bsz_zero_leaves_device_0_out_of_compute():
    class WhereAmI(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(1, 1)

        def forward(self, x):
            return self.lin(x), torch.full((x.shape[0],), current_device_index())

    torch.manual_seed(0)
    model = WhereAmI()
    single = copy.deepcopy(model)
    bdp = gc.BalancedDataParallel(0, model, device_ids=_devs(3))
    x = torch.randn(8, 1)
    out, where = bdp(x)
    assert where.tolist() == [1] * 4 + [2] * 4
    out.square().sum().backward()
    single(x)[0].square().sum().backward()
    for p, q in zip(model.parameters(), single.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)


def test_balanced_data_parallel_overrides_only_scatter():
    own = {name for name, value in vars(gc.BalancedDataParallel).items() if callable(value)}
    steps = {"scatter", "replicate", "parallel_apply", "gather", "forward"}
    assert own & steps == {"scatter"}
    for name in steps - {"scatter"}:
        assert getattr(gc.BalancedDataParallel, name) is getattr(gc.DataParallel, name)


def test_gpu0_bsz_errors():
    with pytest.raises(ValueError, match="gpu0_bsz must be >= 0"):
        gc.BalancedDataParallel(-2, nn.Linear(1, 1), device_ids=_devs(2))
    bdp = gc.BalancedDataParallel(9, nn.Linear(1, 1), device_ids=_devs(3))
    with pytest.raises(ValueError, match=r"gpu0_bsz must be in \[0, 8\].*drop_last=True"):
        bdp(torch.zeros(8, 1))


def test_output_device_that_does_not_exist_is_a_clear_value_error():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"output_device cuda:{count + 3} does not exist"):
        gc.DataParallel(nn.Linear(1, 1), device_ids=gc.virtual_devices(1), output_device=f"cuda:{count + 3}")


def test_gradient_accumulation_over_balanced_micro_batches_equals_the_big_batch():
    """The seeds' recipe: batch 16, acc_grad 2, gpu0_bsz 4 -> BalancedDataParallel(4 // 2): 2+3+3 twice."""
    torch.manual_seed(0)
    model = gc.Net()
    big = copy.deepcopy(model)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    acc_grad = 2
    bdp = gc.BalancedDataParallel(4 // acc_grad, model, device_ids=_devs(3))
    for xs, ys in zip(x.chunk(acc_grad), y.chunk(acc_grad)):
        (F.cross_entropy(bdp(xs), ys) / acc_grad).backward()
    F.cross_entropy(big(x), y).backward()
    for p, q in zip(model.parameters(), big.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4)


# --- on real GPUs: the same API, compared with torch.nn.DataParallel ---------------------------

@pytest.mark.multigpu
def test_matches_torch_data_parallel_on_gpus():
    torch.manual_seed(0)
    model = gc.Net().cuda()
    theirs = copy.deepcopy(model)
    x, y = torch.randn(10, 3, 32, 32, device="cuda"), torch.randint(0, 10, (10,), device="cuda")
    ours_dp = gc.DataParallel(model, device_ids=[0, 1])
    theirs_dp = nn.DataParallel(theirs, device_ids=[0, 1])
    out_a, out_b = ours_dp(x), theirs_dp(x)
    torch.testing.assert_close(out_a, out_b)
    F.cross_entropy(out_a, y).backward()
    F.cross_entropy(out_b, y).backward()
    for p, q in zip(model.parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.multigpu
def test_balanced_on_gpus_matches_one_gpu():
    torch.manual_seed(0)
    model = gc.Net().cuda()
    single = copy.deepcopy(model)
    x = torch.randn(8, 3, 32, 32, device="cuda")
    out = gc.BalancedDataParallel(2, model, device_ids=[0, 1])(x)
    torch.testing.assert_close(out, single(x))


@pytest.mark.cuda
def test_parameters_not_on_device_ids_0_name_the_fix():
    dp = gc.DataParallel(nn.Linear(2, 2), device_ids=[0])           # model still on the CPU
    with pytest.raises(RuntimeError, match=r"model.to\('cuda:0'\)"):
        dp(torch.zeros(2, 2, device="cuda"))
