"""gc.MiniDDP as a drop-in for torch DDP: PyTorch's arguments with PyTorch's meaning, unused
parameters, communication hooks — each run next to torch's DDP on 2 gloo ranks."""

import contextlib
import dataclasses
import inspect
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gpucourse as gc

STEPS = 3
#: torch 2.13 added DDP(forward_sync_buffers=) and deprecated broadcast_buffers= (gc.MiniDDP does
#: as the newer torch; a GPU machine may hold torch 2.11, which has neither)
FORWARD_SYNC_BUFFERS = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
NO_FORWARD_SYNC_BUFFERS = pytest.mark.skipif(
    not FORWARD_SYNC_BUFFERS, reason=f"torch {torch.__version__}'s DDP has no forward_sync_buffers (torch >= 2.13)")


@dataclasses.dataclass
class Prediction:
    """A forward's output as a dataclass (as Hugging Face's ``ModelOutput`` and many scripts return)."""
    logits: torch.Tensor
    note: str = "not a tensor"


class Net(nn.Module):
    """Linear + BatchNorm (a buffer to sync) + Linear; `branch` is used only where `use_branch`."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.branch = nn.Linear(16, 16)
        self.spare = nn.Linear(16, 16)                       # never used anywhere
        self.fc2 = nn.Linear(16, 3)
        self.use_branch = True

    def forward(self, x):
        h = torch.relu(self.bn(self.fc1(x)))
        if self.use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.fc2(h)


def _data(rank, seed):
    g = torch.Generator().manual_seed(seed + 100 * rank)      # different data per rank
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(STEPS)]


def _train(make, rank, seed, branch_on=(0, 1), hook=None):
    torch.manual_seed(seed + rank)                           # a different init per rank
    net = Net()
    model = make(net)
    if hook is not None:
        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step, (x, y) in enumerate(_data(rank, seed)):
        net.use_branch = rank in branch_on
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in net.named_parameters()}
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return losses, state, grads, model


def _same(a, b):
    la, sa, ga, _ = a
    lb, sb, gb, _ = b
    assert la == lb
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    for k in ga:
        assert (ga[k] is None) == (gb[k] is None), (k, ga[k], gb[k])
        assert ga[k] is None or torch.equal(ga[k], gb[k]), k


# --- device_ids / output_device: PyTorch's rules on CPU -----------------------------------------

def _device_ids(rank, world_size):
    out = {}
    for name, cls in (("torch", DDP), ("mini", gc.MiniDDP)):
        for label, call in (("kw", lambda m: cls(m, device_ids=[rank])),
                            ("positional", lambda m: cls(m, [rank])),
                            ("output_device", lambda m: cls(m, output_device=1)),
                            ("two", lambda m: cls(m, device_ids=[0, 1]))):
            try:
                call(nn.Linear(2, 2))
                out[name, label] = None
            except Exception as e:                          # noqa: BLE001 - compared below
                out[name, label] = (type(e).__name__, str(e).split(" but got")[0].split(".")[0])
        for label, ids in (("none", None), ("empty", [])):
            out[name, label] = type(cls(nn.Linear(2, 2), device_ids=ids)).__name__
    return out


def test_device_ids_on_cpu_follow_torch_ddp():
    for out in gc.launch(_device_ids, 2, timeout=60):
        for label in ("kw", "positional", "output_device", "two"):
            assert out["torch", label] is not None and out["torch", label][0] == "ValueError"
            assert out["mini", label] == out["torch", label], label     # same error, same words
        assert out["mini", "none"] == out["mini", "empty"] == "MiniDDP"


# --- arguments that change training: same bits as torch DDP --------------------------------------

CONFIGS = [
    dict(bucket_cap_mb=25),
    dict(bucket_cap_mb=0.001, gradient_as_bucket_view=True),
    dict(bucket_cap_mb=25, broadcast_buffers=False),
    pytest.param(dict(bucket_cap_mb=25, forward_sync_buffers=False), marks=NO_FORWARD_SYNC_BUFFERS),
    dict(bucket_cap_mb=25, static_graph=True),
    dict(bucket_cap_mb=25, find_unused_parameters=True),
    dict(bucket_cap_mb=25, init_sync=False),
    dict(bucket_cap_mb=25, check_reduction=True),
]


def _arguments(rank, world_size, seed, config):
    warnings.simplefilter("ignore", FutureWarning)
    # Net.spare is unused everywhere: only find_unused_parameters/static_graph allow it, so
    # the other configs train a Net without it
    unused_ok = config.get("find_unused_parameters") or config.get("static_graph")

    def strip(net):
        if not unused_ok:
            net.spare.requires_grad_(False)
        return net

    torch_run = _train(lambda n: DDP(strip(n), **config), rank, seed)
    mini_run = _train(lambda n: gc.MiniDDP(strip(n), **config), rank, seed)
    _same(torch_run, mini_run)
    model = mini_run[3]
    views = None
    if config.get("gradient_as_bucket_view"):           # each .grad now lives in its bucket
        views = all(any(p.grad.data_ptr() >= b.buffer.data_ptr()
                        and p.grad.data_ptr() < b.buffer.data_ptr() + b.buffer.nbytes
                        for b in model._buckets) for p in model._params)
    return mini_run[1], views


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_torch_arguments_train_bit_for_bit_like_ddp(config):
    (s0, views0), (s1, views1) = gc.launch(_arguments, 2, args=(7, config), timeout=120)
    if config.get("gradient_as_bucket_view"):
        assert views0 and views1
    # each rank equals torch's (checked in the run); init_sync=False keeps each rank's own start
    assert torch.equal(s0["fc1.weight"], s1["fc1.weight"]) == config.get("init_sync", True)


@NO_FORWARD_SYNC_BUFFERS
def test_broadcast_buffers_warns_like_torch():
    def worker(rank, world_size):
        seen = {}
        for name, cls in (("torch", DDP), ("mini", gc.MiniDDP)):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                cls(nn.Linear(2, 2), broadcast_buffers=True)
            seen[name] = [(x.category.__name__, str(x.message)[:40]) for x in w
                          if issubclass(x.category, FutureWarning)]
        return seen
    seen = gc.launch(worker, 2, timeout=60)[0]
    assert seen["mini"] == seen["torch"] and seen["mini"]


# --- unused parameters ---------------------------------------------------------------------------

def _unused(rank, world_size, seed, bucket_cap_mb):
    # fc `branch` used on rank 0 only, `spare` on no rank
    kw = dict(find_unused_parameters=True)
    torch_run = _train(lambda n: DDP(n, bucket_cap_mb=bucket_cap_mb or 25, **kw), rank, seed, branch_on=(0,))
    mini_run = _train(lambda n: gc.MiniDDP(n, bucket_cap_mb=bucket_cap_mb, **kw), rank, seed, branch_on=(0,))
    _same(torch_run, mini_run)
    return mini_run[2]["spare.weight"] is None, mini_run[2]["branch.weight"] is not None


@pytest.mark.parametrize("bucket_cap_mb", [None, 0.001, 25])
def test_find_unused_parameters_equals_torch_ddp(bucket_cap_mb):
    for spare_untouched, branch_averaged in gc.launch(_unused, 2, args=(3, bucket_cap_mb), timeout=120):
        assert spare_untouched and branch_averaged


class _AsDataclass(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return Prediction(self.net(x))


def _unused_without_flag(rank, world_size, bucket_cap_mb, branch_on, freeze_spare, dataclass_output=False):
    torch.manual_seed(0)
    net = Net()
    net.spare.requires_grad_(not freeze_spare)
    model = gc.MiniDDP(_AsDataclass(net) if dataclass_output else net, bucket_cap_mb=bucket_cap_mb)
    net.use_branch = rank in branch_on
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))
    try:
        out = model(x)
        (out.logits if dataclass_output else out).sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("dataclass_output", [False, True], ids=["tensor output", "dataclass output"])
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.001, 25])
def test_a_parameter_used_on_one_rank_only_raises_on_every_rank(bucket_cap_mb, dataclass_output):
    """Used to hang (buckets) or abort gloo / pair the wrong gradients (no buckets); where the forward
    returns a ``@dataclass``, without buckets, gloo aborted rank 0 until 2026-12-06 (the check found
    no tensor in the output and refused nothing)."""
    out = gc.launch(_unused_without_flag, 2, args=(bucket_cap_mb, (0,), True, dataclass_output), timeout=60)
    for message in out:
        assert message is not None and "branch.weight" in message
        assert "find_unused_parameters=True" in message


@pytest.mark.parametrize("bucket_cap_mb", [None, 0.001, 25])
def test_a_parameter_unused_everywhere_raises_on_every_rank(bucket_cap_mb):
    """torch DDP refuses it (at the next iteration); without buckets MiniDDP used to train on."""
    out = gc.launch(_unused_without_flag, 2, args=(bucket_cap_mb, (0, 1), False), timeout=60)
    for message in out:
        assert message is not None and "spare.weight" in message and "branch" not in message
        assert "received no gradient on any rank" in message


def _read_outside_forward(rank, world_size, seed, bucket_cap_mb):
    """`spare` is read only in the loss, outside forward, on every rank: no flag needed, as in DDP."""
    def train(build):
        torch.manual_seed(seed + rank)
        net = Net()
        model = build(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _data(rank, seed):
            opt.zero_grad()
            spare = net.spare.weight.square().mean() + net.spare.bias.square().mean()
            loss = nn.functional.mse_loss(model(x), y) + spare
            loss.backward()
            opt.step()
        return {k: v.detach().clone() for k, v in net.state_dict().items()}

    torch_state = train(lambda net: DDP(net, bucket_cap_mb=bucket_cap_mb or 25))
    mini_state = train(lambda net: gc.MiniDDP(net, bucket_cap_mb=bucket_cap_mb))
    return all(torch.equal(torch_state[k], mini_state[k]) for k in torch_state)


@pytest.mark.parametrize("bucket_cap_mb", [None, 25])
def test_a_weight_read_only_outside_forward_is_not_refused_and_trains_as_ddp(bucket_cap_mb):
    """The no-bucket check sees forward's graph only: a weight first read in the loss still gets
    its gradient, averaged, as DDP does — refusing it would be a false alarm."""
    assert all(gc.launch(_read_outside_forward, 2, args=(5, bucket_cap_mb), timeout=120))


# --- communication hooks -------------------------------------------------------------------------

def _mean_hook(state, bucket):
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _hooks(rank, world_size, seed, cap):
    calls = []

    def noting(state, bucket):
        grads = bucket.gradients()
        assert all(g.shape == p.shape for g, p in zip(grads, bucket.parameters()))
        calls.append((bucket.index(), bucket.is_last(), bucket.buffer().numel(),
                      sum(p.numel() for p in bucket.parameters())))
        return _mean_hook(state, bucket)

    def strip(net):
        net.spare.requires_grad_(False)
        return net

    torch_run = _train(lambda n: DDP(strip(n), bucket_cap_mb=cap), rank, seed, hook=noting)
    torch_calls, calls[:] = list(calls), []
    mini_run = _train(lambda n: gc.MiniDDP(strip(n), bucket_cap_mb=cap), rank, seed, hook=noting)
    _same(torch_run, mini_run)
    errors = []
    for make in (lambda: gc.MiniDDP(nn.Linear(2, 2)),
                 lambda: gc.MiniDDP(nn.Linear(2, 2), bucket_cap_mb=1)):
        model = make()
        try:
            model.register_comm_hook(None, _mean_hook)
            model.register_comm_hook(None, _mean_hook)
        except RuntimeError as e:
            errors.append(str(e))
    return torch_calls, calls, errors


def test_register_comm_hook_equals_torch_ddp():
    for torch_calls, calls, errors in gc.launch(_hooks, 2, args=(5, 25), timeout=120):
        assert calls and all(n == m for _, _, n, m in calls)
        last = [c for c in calls if c[1]]
        assert len(last) == STEPS and all(i == max(c[0] for c in calls) for i, *_ in last)
        assert sum(n for *_, n, _ in calls) == sum(n for *_, n, _ in torch_calls)
        assert "bucket_cap_mb" in errors[0] and "only be called once" in errors[1]


# --- arguments MiniDDP refuses ------------------------------------------------------------------

def _refused(rank, world_size):
    from torch.distributed.algorithms.join import Join
    errors = {}
    model = gc.MiniDDP(nn.Linear(2, 2))
    try:
        with Join([model]):
            pass
    except NotImplementedError as e:
        errors["join"] = str(e)
    for kw in (dict(mixed_precision=object()), dict(device_mesh=object()), dict(no_such_arg=1)):
        try:
            gc.MiniDDP(nn.Linear(2, 2), **kw)
        except (NotImplementedError, TypeError) as e:
            errors[next(iter(kw))] = (type(e).__name__, str(e))
    try:
        gc.MiniDDP(nn.Linear(2, 2), gradient_as_bucket_view=True)
    except ValueError as e:
        errors["view"] = str(e)
    return errors


def test_what_minddp_does_not_implement_is_refused_with_a_message():
    errors = gc.launch(_refused, 2, timeout=60)[0]
    assert "same number of batches" in errors["join"]
    assert errors["mixed_precision"][0] == "NotImplementedError" and "autocast" in errors["mixed_precision"][1]
    assert "process_group=" in errors["device_mesh"][1]
    assert errors["no_such_arg"][0] == "TypeError"
    assert "bucket_cap_mb" in errors["view"]


def _no_sync_branch(rank, world_size, bucket_cap_mb, which):
    """`branch` takes part in the first micro-batch of each step only (under no_sync), on every
    rank; `spare` in none."""
    torch.manual_seed(3)
    net = Net()
    cls = DDP if which == "torch" else gc.MiniDDP
    model = cls(net, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = _data(rank, 11) + _data(rank, 12)
    for step in range(STEPS):
        for micro in (0, 1):
            x, y = data[2 * step + micro]
            net.use_branch = micro == 0
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("bucket_cap_mb", [0.001, 25])
def test_a_parameter_used_only_under_no_sync_is_averaged_as_ddp(bucket_cap_mb):
    """DDP counts a parameter used in a no_sync() micro-batch as used at the next sync and averages
    its accumulated gradient; MiniDDP left each rank's own sum in .grad, and the ranks drifted apart."""
    refs = gc.launch(_no_sync_branch, 2, args=(bucket_cap_mb, "torch"), timeout=120)
    assert torch.equal(refs[0]["branch.weight"], refs[1]["branch.weight"])       # DDP: ranks in step
    for ours, ref in zip(gc.launch(_no_sync_branch, 2, args=(bucket_cap_mb, "mini"), timeout=120), refs):
        for k in ref:                   # rank by rank: BatchNorm's running statistics are per rank
            assert torch.equal(ours[k], ref[k]), k


class _Boom(torch.autograd.Function):
    """Identity whose backward raises: a backward that dies halfway, after the later layers'
    gradients (and, with small buckets, their all-reduces) are under way."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


def _after_a_failed_backward(rank, world_size, bucket_cap_mb, hook, fail):
    torch.manual_seed(7)
    net = Net()
    net.spare.requires_grad_(False)
    model = gc.MiniDDP(net, bucket_cap_mb=bucket_cap_mb, trace=True)
    if hook is not None:
        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = _data(rank, 21)
    armed = net.fc1.register_forward_hook(lambda m, i, out: _Boom.apply(out))
    out = model(data[0][0])                   # the same forward (BatchNorm's statistics move) in both
    armed.remove()
    error = None
    if fail:                                  # on every rank alike, as a cell that raises does
        try:
            nn.functional.mse_loss(out, data[0][1]).backward()
        except RuntimeError as e:
            error = str(e)
    opt.zero_grad()
    for x, y in data:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return error, {k: v.detach().clone() for k, v in net.state_dict().items()}, len(model.traces)


@pytest.mark.parametrize("bucket_cap_mb,hook", [(None, None), (0.001, None), (25, None), (0.001, _mean_hook)],
                         ids=["no-buckets", "small-buckets", "one-bucket", "small-buckets-hook"])
def test_a_backward_that_raised_halfway_leaves_no_trace_in_the_next_step(bucket_cap_mb, hook):
    """A backward that raises (an error in autograd, a KeyboardInterrupt in a cell) never reaches
    its end. MiniDDP with buckets kept the dead backward's filled slots and its "finish queued" flag:
    the next backward skipped those slots and never copied the averages back, so every rank trained
    on its own gradients. torch DDP refuses the next forward there; MiniDDP waits for what the dead
    backward launched and starts clean."""
    refs = gc.launch(_after_a_failed_backward, 2, args=(bucket_cap_mb, hook, False), timeout=120)
    runs = gc.launch(_after_a_failed_backward, 2, args=(bucket_cap_mb, hook, True), timeout=120)
    for (error, state, traces), (_, ref, ref_traces) in zip(runs, refs):
        assert error == "boom in backward"
        for k in ref:
            assert torch.equal(state[k], ref[k]), k
        assert traces == ref_traces == STEPS              # each step's finish ran (and was traced)
    assert torch.equal(runs[0][1]["fc1.weight"], runs[1][1]["fc1.weight"])


class _Checkpointed(nn.Module):
    """fc1 → a block run under torch.utils.checkpoint(use_reentrant=True) → fc2: the block's
    gradients arrive in a backward nested in the outer one (a graph task of its own)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.block, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.block(t)), h, use_reentrant=True)
        return self.fc2(h)


def _reentrant(rank, world_size, way, bucket_cap_mb):
    torch.manual_seed(4)
    net = _Checkpointed()
    model = DDP(net) if way == "torch" else gc.MiniDDP(net, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _data(rank, 31):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("bucket_cap_mb", [None, 0.001, 25])
def test_reentrant_checkpointing_trains_as_ddp(bucket_cap_mb):
    """The checkpointed block's hooks run in a nested backward: it must not count as a new
    backward (finishing it there would average the buckets before the outer layers' gradients)."""
    refs = gc.launch(_reentrant, 2, args=("torch", None), timeout=120)
    for ours, ref in zip(gc.launch(_reentrant, 2, args=("mini", bucket_cap_mb), timeout=120), refs):
        for k in ref:
            assert torch.equal(ours[k], ref[k]), k


def _twice(rank, world_size, way, bucket_cap_mb=None):
    """``loss.backward(retain_graph=True)``, then a second backward of the same graph (no new forward)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    model = {"ddp": lambda: DDP(net), "mini": lambda: gc.MiniDDP(net, bucket_cap_mb=bucket_cap_mb),
             "one process": lambda: net}[way]()
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    if way != "one process":
        x, y = x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    (0.5 * loss).backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


@pytest.mark.parametrize("bucket_cap_mb", [None, 25])
def test_a_second_backward_of_the_same_graph_is_averaged_unlike_ddp(bucket_cap_mb):
    """The README's "differs" row: MiniDDP averages every backward, so after a second backward of the
    same graph the ranks hold equal gradients, those of one process on the whole batch. DDP averages
    only the first backward after a forward: each rank keeps its own second gradient, and the ranks
    drift apart (measured 0.25 apart here, torch 2.14)."""
    whole = gc.launch(_twice, 1, args=("one process",), timeout=60)[0]
    ours = gc.launch(_twice, 2, args=("mini", bucket_cap_mb), timeout=60)
    assert torch.equal(ours[0], ours[1])
    torch.testing.assert_close(ours[0], whole, rtol=1e-5, atol=1e-6)
    theirs = gc.launch(_twice, 2, args=("ddp",), timeout=60)
    assert (theirs[0] - theirs[1]).abs().max() > 1e-2
