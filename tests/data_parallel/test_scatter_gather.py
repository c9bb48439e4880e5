"""scatter / replicate / parallel_apply / gather on CPU virtual devices; torch and the single device are the oracles."""

import collections
import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import gpucourse as gc
from gpucourse.data_parallel.device_workers import current_device_index

DEVS = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


# --- scatter ------------------------------------------------------------------------------------

@given(st.integers(1, 200), st.integers(1, 9))
def test_chunk_sizes_follow_torch_chunk(batch, n):
    assert gc.chunk_sizes_of(batch, n) == [len(c) for c in torch.arange(batch).chunk(n)]


#: sizes far beyond float64's 2**53, where ``math.ceil(batch / n)`` is no longer exact
HUGE = st.integers(0, 2**70)


def _exact_chunk_rule(batch, n):
    """torch.chunk's rule in Python ints: chunks of ceil(batch / n), the last one what is left."""
    if batch == 0:
        return []
    step = (batch + n - 1) // n
    full, rest = divmod(batch, step)
    return [step] * full + ([rest] if rest else [])


@settings(max_examples=300)
@given(HUGE, st.integers(1, 5000))
def test_chunk_sizes_of_is_integer_exact(batch, n):
    sizes = gc.chunk_sizes_of(batch, n)
    assert sizes == _exact_chunk_rule(batch, n)
    assert all(type(s) is int and s > 0 for s in sizes) and sum(sizes) == batch
    assert len(sizes) <= n                                   # never more chunks than devices
    if sizes:
        step = sizes[0]
        assert (step - 1) * n < batch <= step * n            # step == ceil(batch / n), exactly
        assert all(s == step for s in sizes[:-1]) and 0 < sizes[-1] <= step


def test_chunk_sizes_of_huge_batch_regression():
    """Issue 30: float division gave 400 chunks for 399 devices."""
    sizes = gc.chunk_sizes_of(1869773657305771023, 399)
    assert len(sizes) == 399 and sum(sizes) == 1869773657305771023


@settings(deadline=None, max_examples=40)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=4), st.integers(0, 2), st.integers(1, 3))
def test_scatter_with_chunk_sizes_splits_exactly(sizes, dim, width):
    shape = [width, width, width]
    shape[dim] = sum(sizes)
    x = torch.randn(shape)
    devs = DEVS[:len(sizes)]
    chunks = gc.scatter(x, devs, chunk_sizes=sizes, dim=dim)
    assert [c.shape[dim] for c in chunks] == [s for s in sizes if s > 0]
    if chunks:
        torch.testing.assert_close(torch.cat(chunks, dim), x)


def test_scatter_default_split_views_on_device_0_and_copies_elsewhere():
    x = torch.randn(7, 3)
    chunks = gc.scatter(x, DEVS[:3])
    assert [len(c) for c in chunks] == [3, 3, 1]
    assert chunks[0].data_ptr() == x.data_ptr()                     # already on cpu:0
    assert chunks[1].data_ptr() != x[3:].data_ptr()                 # a copy "on" cpu:1
    torch.testing.assert_close(torch.cat(chunks), x)


def test_scatter_fewer_rows_than_devices():
    assert [len(c) for c in gc.scatter(torch.zeros(3, 2), DEVS)] == [1, 1, 1]


def test_scatter_structures_and_shared_objects():
    Pair = collections.namedtuple("Pair", "a b")
    x, m = torch.randn(4, 2), torch.randn(4)
    obj = object()
    out = gc.scatter((x, {"mask": m}, Pair(x, obj), obj), DEVS[:2])
    assert len(out) == 2
    torch.testing.assert_close(out[1][0], x[2:])
    torch.testing.assert_close(out[1][1]["mask"], m[2:])
    assert isinstance(out[0][2], Pair) and out[0][2].b is obj and out[1][3] is obj


def test_scatter_is_differentiable():
    x = torch.randn(5, 3, requires_grad=True)
    chunks = gc.scatter(x, DEVS[:2], chunk_sizes=[2, 3])
    (chunks[0].sum() * 2 + chunks[1].sum() * 3).backward()
    torch.testing.assert_close(x.grad, torch.tensor([2.] * 2 + [3.] * 3)[:, None].expand(5, 3))


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk_sizes=[1, 1]), "add up to 2, but the tensor has 4 rows"),
    (dict(chunk_sizes=[4]), "1 entries for 2 devices"),
    (dict(chunk_sizes=[5, -1]), "ints >= 0"),
    (dict(dim=3), "dim=3 is out of range"),
])
def test_scatter_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gc.scatter(torch.zeros(4, 2), DEVS[:2], **kwargs)


def test_scatter_rejects_scalars_and_bad_devices():
    with pytest.raises(ValueError, match="0-dim"):
        gc.scatter(torch.tensor(1.0), DEVS[:2])
    with pytest.raises(ValueError, match="empty"):
        gc.scatter(torch.zeros(4), [])
    with pytest.raises(ValueError, match="twice"):
        gc.scatter(torch.zeros(4), ["cpu:1", "cpu:1"])
    with pytest.raises(TypeError):
        gc.scatter(torch.zeros(4), "cpu:0")


def test_scatter_kwargs_pads_to_the_same_length():
    args, kwargs = gc.scatter_kwargs((), {"x": torch.zeros(4, 1)}, DEVS[:2])
    assert args == [(), ()] and [k["x"].shape[0] for k in kwargs] == [2, 2]
    args, kwargs = gc.scatter_kwargs((torch.zeros(3, 1),), None, DEVS[:3])
    assert len(args) == 3 and kwargs == [{}, {}, {}]


# --- replicate ----------------------------------------------------------------------------------

def test_replicas_compute_like_the_module_and_sum_gradients_into_it():
    torch.manual_seed(0)
    net = gc.MLP(5, 7, 3)
    ref = gc.MLP(5, 7, 3)
    ref.load_state_dict(net.state_dict())
    x = torch.randn(6, 5)
    replicas = gc.replicate(net, DEVS[:3])
    assert all(list(r.parameters()) == [] for r in replicas)     # plain tensors, like PyTorch
    loss = sum(r(x[2 * i:2 * i + 2]).square().sum() for i, r in enumerate(replicas))
    loss.backward()
    ref(x).square().sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_replicate_shares_storage_on_device_0_only_and_detaches_without_grad():
    net = nn.BatchNorm1d(3)
    r0, r1 = gc.replicate(net, DEVS[:2])
    assert r0.weight.data_ptr() == net.weight.data_ptr() and r1.weight.data_ptr() != net.weight.data_ptr()
    assert r0.running_mean is net.running_mean and r1.running_mean is not net.running_mean
    assert r1.weight.grad_fn is not None
    with torch.no_grad():
        assert gc.replicate(net, DEVS[:2])[1].weight.grad_fn is None


# --- parallel_apply -----------------------------------------------------------------------------

def test_parallel_apply_matches_sequential_application_with_kwargs():
    class Scale(nn.Module):
        def forward(self, x, *, factor):
            return x * factor, current_device_index()

    xs = [torch.randn(2, 3) for _ in range(3)]
    outs = gc.parallel_apply([Scale() for _ in range(3)], [(x,) for x in xs], DEVS[:3],
                             kwargs_tup=[{"factor": i} for i in range(3)])
    for i, (y, where) in enumerate(outs):
        torch.testing.assert_close(y, xs[i] * i)
        assert where == i                       # ran on that device's worker thread


def test_parallel_apply_is_concurrent_in_forward_and_backward():
    """Both replicas must be inside forward (and inside backward) at the same time, else a barrier times out."""
    forward_barrier, backward_barrier = threading.Barrier(2, timeout=20), threading.Barrier(2, timeout=20)

    class MeetInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            backward_barrier.wait()             # BrokenBarrierError unless the other replica is here too
            return g

    class Meet(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            forward_barrier.wait()
            return MeetInBackward.apply(self.lin(x))

    model = Meet()
    dp = gc.DataParallel(model, device_ids=DEVS[:2])
    with gc.record_timeline() as timeline:
        dp(torch.randn(8, 4)).sum().backward()
    assert model.lin.weight.grad is not None
    rows = {row for row, label, *_ in timeline.spans if label == "backward"}
    assert rows == {"cpu:0", "cpu:1"}
    assert timeline.overlap("backward") > 0 and timeline.overlap("forward") > 0


def test_parallel_apply_reraises_with_the_replica_named():
    class Boom(nn.Module):
        def forward(self, x):
            if current_device_index() == 1:
                raise ValueError("bad chunk")
            return x

    with pytest.raises(ValueError, match="bad chunk") as info:
        gc.parallel_apply([Boom(), Boom()], [torch.ones(1), torch.ones(1)], DEVS[:2])
    assert "replica 1 on device cpu:1" in " ".join(info.value.__notes__)


def test_parallel_apply_same_module_twice_is_correct_and_warns():
    net = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with pytest.warns(UserWarning, match="share a submodule"):
        outs = gc.parallel_apply([net, net], [x[:2], x[2:]], DEVS[:2])
    torch.cat(outs).sum().backward()
    g = net.weight.grad.clone()
    net.weight.grad = None
    net(x).sum().backward()
    torch.testing.assert_close(g, net.weight.grad)


def test_parallel_apply_refuses_hidden_tensors_that_need_grad():
    hidden = torch.ones(3, requires_grad=True)

    class UsesGlobal(nn.Module):
        def forward(self, x):
            return x * hidden

    with pytest.raises(RuntimeError, match="neither arguments nor parameters"):
        gc.parallel_apply([UsesGlobal(), UsesGlobal()], [torch.ones(2, 3), torch.ones(2, 3)], DEVS[:2])


def test_backward_twice_is_a_clear_error():
    dp = gc.DataParallel(nn.Linear(3, 1), device_ids=DEVS[:2])
    out = dp(torch.randn(4, 3)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        out.backward()


def test_parallel_apply_length_checks():
    with pytest.raises(ValueError, match="2 modules but 1 inputs"):
        gc.parallel_apply([nn.Identity(), nn.Identity()], [torch.ones(1)])


# --- gather -------------------------------------------------------------------------------------

@settings(deadline=None, max_examples=25)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(0, 1))
def test_gather_is_torch_cat_and_splits_gradients_back(sizes, dim):
    parts = [torch.randn(*((s, 3) if dim == 0 else (3, s)), requires_grad=True) for s in sizes]
    out = gc.gather(parts, "cpu:0", dim=dim)
    torch.testing.assert_close(out, torch.cat(parts, dim))
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    for p, w in zip(parts, weights.split(sizes, dim)):
        torch.testing.assert_close(p.grad, w)


def test_gather_structures_and_scalars():
    out = gc.gather([{"a": torch.zeros(1), "b": (torch.ones(2), None)}] * 2, "cpu:1")
    assert out["a"].shape == (2,) and out["b"][0].shape == (4,) and out["b"][1] is None
    with pytest.warns(UserWarning, match="scalars"):
        v = gc.gather([torch.tensor(1.0), torch.tensor(2.0)], "cpu:0")
    assert v.tolist() == [1.0, 2.0]
    with pytest.raises(TypeError, match="cannot gather"):
        gc.gather([1, 2], "cpu:0")
    with pytest.raises(ValueError, match="same keys"):
        gc.gather([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], "cpu:0")


def test_no_grad_path_has_no_graph():
    dp = gc.DataParallel(nn.Linear(3, 2), device_ids=DEVS[:2])
    with torch.no_grad():
        out = dp(torch.randn(4, 3))
    assert out.grad_fn is None and not out.requires_grad
