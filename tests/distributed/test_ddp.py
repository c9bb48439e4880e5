"""MiniDDP equals torch.nn.parallel.DistributedDataParallel; data parallel equals one big batch."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gpucourse as gc

STEPS = 3


class SmallConvNet(nn.Module):
    """Conv + BatchNorm (buffers to broadcast) + two Linear layers (several buckets)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _batches(rank, seed, n, micro):
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    return [[(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g))
             for _ in range(micro)] for _ in range(n)]


def _train(model, batches, accumulate):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for micro in batches:
        opt.zero_grad()
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            ctx = model.no_sync() if (accumulate and not last) else _nothing()
            with ctx:
                nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    inner = model.module
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _compare_worker(rank, world_size, seed, configs):
    out = {}
    for name, accumulate, bucket_cap_mb in configs:
        torch.manual_seed(seed + rank)                      # a different init on every rank:
        batches = _batches(rank, seed, STEPS, 2 if accumulate else 1)   # the broadcast must fix it
        if name == "torch":
            model = DDP(SmallConvNet(), bucket_cap_mb=bucket_cap_mb)
        else:
            model = gc.MiniDDP(SmallConvNet(), bucket_cap_mb=bucket_cap_mb)
            if bucket_cap_mb is not None:
                out[f"nbuckets {bucket_cap_mb}"] = len(model._buckets)
        out[(name, accumulate, bucket_cap_mb)] = _train(model, batches, accumulate)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_minddp_parameters_equal_torch_ddp(world_size):
    configs = [("torch", False, 25), ("mini", False, None), ("mini", False, 0.002),
               ("mini", False, 25), ("torch", True, 25), ("mini", True, None), ("mini", True, 0.002)]
    results = gc.launch(_compare_worker, world_size, args=(11, configs), timeout=120)
    assert results[0]["nbuckets 0.002"] >= 3 and results[0]["nbuckets 25"] == 1
    for rank, res in enumerate(results):
        for name, accumulate, cap in configs:
            got = res[(name, accumulate, cap)]
            want = res[("torch", accumulate, 25)]              # torch DDP on the same rank
            assert got.keys() == want.keys()
            for key in want:  # every config: the same parameters *and* buffers as torch DDP
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} {name} acc={accumulate} "
                                                         f"cap={cap} {key}: {m}")
            # parameters (not the BatchNorm statistics of each rank's last batch) agree across ranks
            for key, value in got.items():
                if "running" not in key and "num_batches" not in key:
                    torch.testing.assert_close(value, results[0][(name, accumulate, cap)][key])
    # accumulation really changed the result (the no_sync test is not vacuous)
    a = results[0][("torch", True, 25)]["fc2.weight"]
    b = results[0][("torch", False, 25)]["fc2.weight"]
    assert not torch.allclose(a, b)


def _mlp_worker(rank, world_size, seed, mode):
    torch.manual_seed(seed)                                  # same init (also broadcast by DDP)
    g = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(world_size * 6, 10, generator=g), torch.randn(world_size * 6, 3, generator=g)
    mine = slice(rank * 6, (rank + 1) * 6)                     # this rank's part of the batch
    model = gc.MLP(10, 16, 3)
    if mode == "average_gradients":
        wrapped = model
    else:
        wrapped = gc.MiniDDP(model, bucket_cap_mb=None if mode == "naive" else 0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(wrapped(x[mine]), y[mine]).backward()
        if mode == "average_gradients":
            gc.average_gradients(model)
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["average_gradients", "naive", "bucketed"])
def test_two_ranks_with_batch_b_equal_one_process_with_batch_2b(mode):
    seed = 5
    results = gc.launch(_mlp_worker, 2, args=(seed, mode), timeout=60)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(12, 10, generator=g), torch.randn(12, 3, generator=g)
    model = gc.MLP(10, 16, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for rank_params in results:
        for got, want in zip(rank_params, model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


class TiedAndFrozen(nn.Module):
    """A head tied to the embedding (one parameter, two gradients) and a frozen layer between them."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.frozen = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.frozen.requires_grad_(False)

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.frozen(self.emb(idx).mean(1)))))


def _tied_frozen_worker(rank, world_size, bucket_caps):
    out = {}
    for cap in bucket_caps:
        torch.manual_seed(3 + rank)                          # a different init per rank: broadcast fixes it
        model = TiedAndFrozen()
        wrapped = DDP(model) if cap == "torch" else gc.MiniDDP(model, bucket_cap_mb=cap)
        opt = torch.optim.AdamW(model.parameters(), lr=0.02)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            idx, y = torch.randint(0, 16, (8, 5), generator=g), torch.randint(0, 16, (8,), generator=g)
            mine = slice(rank * 4, rank * 4 + 4)
            nn.functional.cross_entropy(wrapped(idx[mine]), y[mine]).backward()
            opt.step()
            opt.zero_grad()
        out[cap] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if cap not in ("torch", None):
            out[f"buckets {cap}"] = [len(b.params) for b in wrapped._buckets]
    return out


def test_tied_weights_frozen_layers_and_uneven_buckets_equal_torch_ddp_bit_for_bit():
    """2 ranks: the average (a + b) / 2 is exact whichever order it is computed in, so MiniDDP's
    parameters equal torch DDP's exactly, however the gradients are bucketed."""
    caps = ["torch", None, 0.0003, 25]
    for res in gc.launch(_tied_frozen_worker, 2, args=(caps,), timeout=120):
        # 3 trainable parameters (the tied one once): mid.bias + mid.weight, then the embedding
        assert res["buckets 0.0003"] == [2, 1] and res["buckets 25"] == [3]
        for cap in caps[1:]:
            for k, v in res["torch"].items():
                assert torch.equal(res[cap][k], v), f"bucket_cap_mb={cap} {k}"
        assert torch.equal(res[None]["frozen.weight"], _initial_frozen_weight())


def _initial_frozen_weight():
    torch.manual_seed(3)                                     # rank 0's init, broadcast to every rank
    return TiedAndFrozen().frozen.weight.detach()


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.used(x)


def _unused_worker(rank, world_size):
    model = gc.MiniDDP(WithUnused(), bucket_cap_mb=25)
    try:
        model(torch.randn(2, 3)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_unused_parameter_raises_a_clear_error_instead_of_hanging():
    for msg in gc.launch(_unused_worker, 2, timeout=60):
        assert "unused.weight" in msg and "find_unused_parameters" in msg


def _trace_worker(rank, world_size):
    model = gc.MiniDDP(gc.MLP(64, 256, 256, 10), bucket_cap_mb=0.1, trace=True)
    for _ in range(2):
        model(torch.randn(8, 64)).sum().backward()
    with model.no_sync():                                   # not traced: no communication
        model(torch.randn(8, 64)).sum().backward()
    return [(t.backward_start, t.backward_end, t.synced, t.comms) for t in model.traces]


def test_trace_records_a_consistent_timeline():
    traces = gc.launch(_trace_worker, 2, timeout=60)
    for rank_traces in traces:
        assert len(rank_traces) == 2
        for start, end, synced, comms in rank_traces:
            assert start <= end <= synced
            assert len(comms) >= 2
            for label, nbytes, launched, finished in comms:
                assert label.startswith("bucket") and nbytes > 0
                assert start <= launched <= finished <= synced


def _bad_args(rank, world_size):
    errors = []
    for kwargs in (dict(bucket_cap_mb=0), dict(bucket_cap_mb="25")):
        try:
            gc.MiniDDP(nn.Linear(2, 2), **kwargs)
        except ValueError as e:
            errors.append(str(e))
    try:
        gc.MiniDDP("not a module")
    except TypeError as e:
        errors.append(str(e))
    return errors


def test_bad_arguments():
    errors = gc.launch(_bad_args, 1, timeout=60)[0]
    assert len(errors) == 3 and "bucket_cap_mb" in errors[0] and "'25'" in errors[1]
    with pytest.raises(RuntimeError, match="init_process_group"):
        gc.MiniDDP(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="init_process_group"):
        gc.average_gradients(nn.Linear(2, 2))


def _count_worker(rank, world_size, bucket_cap_mb):
    model = gc.MiniDDP(gc.MLP(8, 32, 32, 4), bucket_cap_mb=bucket_cap_mb)
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        with model.no_sync():
            model(torch.randn(4, 8)).sum().backward()
            model(torch.randn(4, 8)).sum().backward()
        silent = len(calls)
        model(torch.randn(4, 8)).sum().backward()
    finally:
        dist.all_reduce = real
    return silent, len(calls) - silent, len(model._buckets)


@pytest.mark.parametrize("bucket_cap_mb", [None, 0.001, 25])
def test_no_sync_communicates_nothing_and_the_next_backward_once(bucket_cap_mb):
    for silent, synced, nbuckets in gc.launch(_count_worker, 2, args=(bucket_cap_mb,), timeout=60):
        assert silent == 0
        # 3 Linear = 6 tensors; without buckets + 1 small all-reduce in forward: the same
        # parameters are used on every rank (else the per-gradient all-reduces would pair wrongly)
        assert synced == (6 + 1 if bucket_cap_mb is None else nbuckets)
        assert bucket_cap_mb != 0.001 or nbuckets > 1


def test_plot_step_trace_draws_real_traces():
    import matplotlib
    matplotlib.use("Agg")
    traces = gc.launch(_plot_worker, 2, timeout=60)[0]
    ax = gc.plot_step_trace(traces[-1], title="t")
    assert len(ax.collections) >= 1 + len(traces[-1].comms)      # backward + a bar per bucket
    with pytest.raises(ValueError, match="complete StepTrace"):
        gc.plot_step_trace(gc.StepTrace())


def _plot_worker(rank, world_size):
    model = gc.MiniDDP(gc.MLP(32, 64, 8), bucket_cap_mb=0.005, trace=True)
    model(torch.randn(4, 32)).sum().backward()
    return model.traces


def _different_models(rank, world_size, bucket_cap_mb):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2 + rank))  # rank 1: one output more
    try:
        gc.MiniDDP(model, bucket_cap_mb=bucket_cap_mb)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("bucket_cap_mb", [None, 1])
def test_a_different_model_per_rank_raises_at_construction_on_every_rank(bucket_cap_mb):
    out = gc.launch(_different_models, 2, args=(bucket_cap_mb,), timeout=60)   # used to hang
    assert all(m is not None and "must be the same on every rank" in m for m in out), out
    assert "('2.weight', (2, 8))" in out[0] and "('2.weight', (3, 8))" in out[0]
