"""ZeroOptimizer as a drop-in for DDP + torch.optim / ZeroRedundancyOptimizer, where it used to train
differently without a word (issue 40): clipping by the global norm, parameters without gradients,
state_dict() without consolidating. Every test runs the PyTorch original next to it on 2 gloo ranks."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import gpucourse as gc

STEPS = 4


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step, rank, world_size):
    g = torch.Generator().manual_seed(500 + step)            # new data every step
    x, y = torch.randn(8, 6, generator=g) * (1 + step), torch.randn(8, 3, generator=g)
    return x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]


def _ddp_or_zero(way):
    """``(model, optimizer)``: DDP + AdamW for ``way="ddp"``, else ``gc.ZeroOptimizer(stage=way)``, same settings."""
    model = make_model()
    if way == "ddp":
        model = DDP(model)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return model, gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=way, lr=0.01, weight_decay=0.1)


def _clip_run(rank, world_size, way, max_norm, accumulation=1):
    model, opt = _ddp_or_zero(way)
    norms = []
    for step in range(STEPS):
        x, y = batch(step, rank, world_size)
        for i, (xm, ym) in enumerate(zip(x.tensor_split(accumulation), y.tensor_split(accumulation))):
            last = i == accumulation - 1
            with model.no_sync() if way == "ddp" and not last else contextlib.nullcontext():
                (F.mse_loss(model(xm), ym) / accumulation).backward()
        if way == "ddp":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        else:
            norm = opt.clip_grad_norm_(max_norm)
        norms.append(norm.item())
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms


@pytest.mark.parametrize("stage, accumulation", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_clip_grad_norm_equals_ddp_and_torch_clip(stage, accumulation):
    """Clipping in every step (max_norm below every norm): norms and parameters equal DDP +
    torch.nn.utils.clip_grad_norm_ within a rounding — torch sums per-parameter norms, the shards
    sum slices, so the norm (and the clip factor) may differ in the last place."""
    max_norm = 0.05
    ddp_params, ddp_norms = gc.launch(_clip_run, 2, args=("ddp", max_norm, accumulation), timeout=120)[0]
    results = gc.launch(_clip_run, 2, args=(stage, max_norm, accumulation), timeout=120)
    assert min(ddp_norms) > 4 * max_norm                       # every step is clipped
    for params, norms in results:                              # the global norm, the same on both ranks
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ddp_norms), rtol=1e-6, atol=0)
        for p, q in zip(params, ddp_params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # (the clipping matters: without it the parameters end far from DDP's)
    unclipped, _ = gc.launch(_clip_run, 2, args=("ddp", 1e9), timeout=120)[0]
    assert max((p - q).abs().max().item() for p, q in zip(unclipped, ddp_params)) > 1e-3


@pytest.mark.parametrize("stage", [1, 2])
def test_clip_grad_norm_that_does_not_clip_is_bit_for_bit(stage):
    """max_norm above every norm: torch multiplies by 1.0, and so does clip_grad_norm_ — the same
    arithmetic, so 2 ranks train bit for bit like DDP."""
    ddp_params, ddp_norms = gc.launch(_clip_run, 2, args=("ddp", 1e9), timeout=120)[0]
    for params, norms in gc.launch(_clip_run, 2, args=(stage, 1e9), timeout=120):
        assert all(torch.equal(p, q) for p, q in zip(params, ddp_params))
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ddp_norms), rtol=1e-6, atol=0)


def _norm_types(rank, world_size, stage, norm_type):
    model = make_model()
    opt = gc.ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=0.1)
    ddp = DDP(make_model())
    sharded = gc.FullyShardedModule(make_model())
    x, y = batch(0, rank, world_size)
    for m in (model, ddp, sharded):
        F.mse_loss(m(x), y).backward()
    return (opt.clip_grad_norm_(0.01, norm_type=norm_type).item(),
            sharded.clip_grad_norm_(0.01, norm_type).item(),
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.01, norm_type=norm_type).item())


@pytest.mark.parametrize("stage, norm_type", [(1, float("inf")), (2, 1.0), (1, 3.0)])
def test_clip_grad_norm_other_norm_types_are_global(stage, norm_type):
    """The inf-norm is a max (no rounding: equal); p-norms sum |g|^p over the ranks' slices."""
    for zero, fsdp, theirs in gc.launch(_norm_types, 2, args=(stage, norm_type), timeout=120):
        if norm_type == float("inf"):
            assert zero == fsdp == theirs
        assert zero == pytest.approx(theirs, rel=1e-6) and fsdp == pytest.approx(theirs, rel=1e-6)


def _torch_clip_on_zero(rank, world_size, stage, change):
    model = make_model()
    opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0, rank, world_size)
    F.mse_loss(model(x), y).backward()
    # a clip written by hand (or by a library other than torch's clip_grad): each rank by the norm
    # of its own un-averaged gradients, which no guard on torch's functions sees; step() refuses it
    own_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    if change == "a per-rank clip by hand":
        for p in model.parameters():
            p.grad.mul_(min(1.0, 0.05 / own_norm.item()))
    elif change == "a per-rank clip that is never reached":
        for p in model.parameters():
            p.grad.mul_(min(1.0, 1e9 / own_norm.item()))
    elif change == "the same factor everywhere":
        for p in model.parameters():
            p.grad.mul_(0.5)
    elif change == "one gradient summed over ranks":                     # as a tied weight across stages
        torch.distributed.all_reduce(model[0].weight.grad)
    try:
        opt.step()
    except RuntimeError as e:
        return str(e), all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    return "no error", None


def _torch_clipping_called_on_zero(rank, world_size, stage, name, arg):
    model = make_model()
    # held in a variable: the guard knows only optimizers that are alive
    opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.01)  # noqa: F841
    x, y = batch(0, rank, world_size)
    F.mse_loss(model(x), y).backward()
    fn = getattr(torch.nn.utils, name) if name != "clip_grad.clip_grad_norm_" else \
        torch.nn.utils.clip_grad.clip_grad_norm_
    try:
        fn(model.parameters(), arg)
    except RuntimeError as e:
        refused = str(e)
    else:
        refused = "not refused"
    other = nn.Linear(3, 2)                               # a model the optimizer does not hold
    other(torch.ones(1, 3)).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(other.parameters(), 1e-3)       # torch's own, unchanged
    return refused, norm.item() > 0 and other.weight.grad.norm().item() <= 1.01e-3


@pytest.mark.parametrize("stage, name, arg", [(2, "clip_grad_norm_", 0.05), (1, "clip_grad_norm_", 0.05),
                                              (2, "clip_grad.clip_grad_norm_", 0.05),
                                              (1, "clip_grad_value_", 0.01), (2, "clip_grad_value_", 0.01)])
def test_torch_clipping_on_zero_parameters_is_refused_at_the_call(stage, name, arg):
    # stage 2: torch's clip_grad_norm_ used to return 0.0 and clip nothing, silently (issue 40);
    # value clipping clamped each rank's own gradients, not their average — silently, in both stages
    right = "opt.clip_grad_norm_(max_norm)" if "norm" in name else "opt.clip_grad_value_(clip_value)"
    for refused, others_clipped in gc.launch(_torch_clipping_called_on_zero, 2, args=(stage, name, arg),
                                             timeout=120):
        assert right in refused and f"ZeroOptimizer(stage={stage})" in refused, refused
        assert others_clipped                            # other parameters: PyTorch's function as ever


def _early(function):
    """PyTorch's own function object, as a script holds it after `from torch.nn.utils import …` at
    its top, before any ZeroOptimizer existed (unwrapped if this process already installed the guard)."""
    return function.__wrapped__ if getattr(function, "_gpucourse_guarded", False) else function


def _torch_clipping_imported_early(rank, world_size, stage, name):
    functions = {n: _early(getattr(torch.nn.utils, n)) for n in
                 ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "get_total_norm")}
    model = make_model()
    opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.01)  # noqa: F841
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0, rank, world_size)
    F.mse_loss(model(x), y).backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    try:
        if name == "clip_grad_norm_":
            functions[name](model.parameters(), 0.05)
        elif name == "clip_grad_value_":
            functions[name](model.parameters(), 0.01)
        else:                                  # the two-step form (torch >= 2.6)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            functions[name](model.parameters(), 0.05, functions["get_total_norm"](grads))
    except RuntimeError as e:
        refused = str(e)
    else:
        refused = "not refused"
    untouched = all((p.grad is None) == (g is None) and (g is None or torch.equal(p.grad, g))
                    for p, g in zip(model.parameters(), grads))
    other = nn.Linear(3, 2)                               # a model the optimizer does not hold
    other(torch.ones(1, 3)).sum().backward()
    functions["clip_grad_value_"](other.parameters(), 1e-3)                # torch's own, unchanged
    return refused, untouched and all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), \
        torch.allclose(other.weight.grad, torch.full((2, 3), 1e-3))         # ones, clamped


@pytest.mark.parametrize("stage, name", [(1, "clip_grad_norm_"), (2, "clip_grad_norm_"), (1, "clip_grad_value_"),
                                         (2, "clip_grad_value_"), (1, "clip_grads_with_norm_"),
                                         (2, "clip_grads_with_norm_")])
def test_torch_clipping_imported_before_the_optimizer_is_refused_at_the_call(stage, name):
    """A script that imported torch's clipping before building the optimizer holds PyTorch's own
    function object: it is refused at the call all the same (stage 2's norm used to be 0.0, and
    value clipping clamped per-rank gradients, silently: issue 40). The two-step form in stage 2 —
    get_total_norm of no gradients, 0.0, then clip_grads_with_norm_ — clipped nothing and was the
    last route the guard missed."""
    right = "opt.clip_grad_value_(clip_value)" if "value" in name else "opt.clip_grad_norm_(max_norm)"
    for refused, untouched, others_clipped in gc.launch(_torch_clipping_imported_early, 2, args=(stage, name),
                                                           timeout=120):
        assert right in refused and f"ZeroOptimizer(stage={stage})" in refused, refused
        assert untouched and others_clipped


def _value_clip_run(rank, world_size, way, clip):
    model, opt = _ddp_or_zero(way)
    for step in range(STEPS):
        x, y = batch(step, rank, world_size)
        F.mse_loss(model(x), y).backward()
        if way == "ddp":
            torch.nn.utils.clip_grad_value_(model.parameters(), clip)
        else:
            opt.clip_grad_value_(clip)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2])
def test_clip_grad_value_equals_ddp_and_torch_clip_bit_for_bit(stage):
    ddp = gc.launch(_value_clip_run, 2, args=("ddp", 0.02), timeout=120)[0]
    mine = gc.launch(_value_clip_run, 2, args=(stage, 0.02), timeout=120)[0]
    unclipped = gc.launch(_value_clip_run, 2, args=("ddp", 1e9), timeout=120)[0]
    assert all(torch.equal(a, b) for a, b in zip(ddp, mine))
    assert not all(torch.equal(a, b) for a, b in zip(ddp, unclipped))     # the clamp acted


def test_a_per_rank_clip_by_hand_is_refused_at_step_naming_the_right_call():
    for msg, untouched in gc.launch(_torch_clip_on_zero, 2, args=(1, "a per-rank clip by hand"), timeout=120):
        assert "opt.clip_grad_norm_(max_norm)" in msg and "scaled" in msg, msg
        assert untouched                                       # refused before anything changed


@pytest.mark.parametrize("change", ["a per-rank clip that is never reached", "the same factor everywhere",
                                    "one gradient summed over ranks"])
def test_gradient_changes_that_are_not_a_per_rank_clip_pass(change):
    """Only a factor that differs between the ranks is refused: a clip that clips nothing,
    a scale shared by all ranks, or an all-reduce of one gradient (a tied weight) train as DDP."""
    for msg, _ in gc.launch(_torch_clip_on_zero, 2, args=(1, change), timeout=120):
        assert msg == "no error"


# --- a parameter that gets no gradient on any rank: torch.optim leaves it as it is ---------------

class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.unused, self.b = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _unused_run(rank, world_size, way, set_to_none):
    model = WithUnused()
    kw = dict(lr=0.01, weight_decay=0.1)
    if way == "ddp":
        model = DDP(model, find_unused_parameters=True)
        opt = torch.optim.AdamW(model.parameters(), **kw)
    elif way == "zero_redundancy":
        model = DDP(model, find_unused_parameters=True)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **kw)
    else:
        opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=way, **kw)
    for step in range(STEPS):
        x, y = batch(step, rank, world_size)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    state = None
    if way != "ddp":
        opt.consolidate_state_dict(to=0)
    if way == "ddp" or rank == 0:
        state = opt.state_dict()
    return {k: v.detach().clone() for k, v in getattr(model, "module", model).state_dict().items()}, state


@pytest.mark.parametrize("stage, set_to_none", [(1, True), (2, True), (1, False), (2, False)])
def test_a_parameter_without_gradient_anywhere_is_left_untouched(stage, set_to_none):
    ddp, ddp_state = gc.launch(_unused_run, 2, args=("ddp", set_to_none), timeout=120)[0]
    zro, _ = gc.launch(_unused_run, 2, args=("zero_redundancy", set_to_none), timeout=120)[0]
    initial = WithUnused().state_dict()
    assert torch.equal(ddp["unused.weight"], initial["unused.weight"])     # what torch does
    for rank, (ours, state) in enumerate(gc.launch(_unused_run, 2, args=(stage, set_to_none), timeout=120)):
        for k in ddp:                                          # 2 ranks: bit for bit, the unused layer too
            assert torch.equal(ours[k], ddp[k]), k
            assert torch.equal(ours[k], zro[k]), k
        if rank == 0:                                          # no state for it, as in torch.optim
            assert state["state"].keys() == ddp_state["state"].keys()
            for i, s in ddp_state["state"].items():
                for key, v in s.items():
                    torch.testing.assert_close(state["state"][i][key], v, atol=1e-7, rtol=1e-6)


class Sometimes(WithUnused):
    def forward(self, x, use):
        h = torch.tanh(self.a(x))
        return self.b(torch.tanh(self.unused(h)) if use else h)


def _sometimes(rank, world_size, stage, first_use):
    model = Sometimes()
    opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.01, weight_decay=0.1)
    for step in range(3):
        x, y = batch(step, rank, world_size)
        F.mse_loss(model(x, use=(step == 0) == first_use), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt.step()
        except RuntimeError as e:
            return step, str(e), all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        opt.zero_grad()
    return None, "no error", None


@pytest.mark.parametrize("stage, first_use", [(1, True), (2, True), (1, False), (2, False)])
def test_a_parameter_used_in_some_steps_only_is_refused(stage, first_use):
    """torch.optim keeps a step count per parameter and skips one without a gradient: a slice
    updated as one tensor cannot (Adam's bias correction would differ) — refused on every rank,
    before anything changed, instead of training differently."""
    for step, msg, untouched in gc.launch(_sometimes, 2, args=(stage, first_use), timeout=120):
        assert step == 1 and untouched, msg
        assert "in some steps and not in others" in msg and "shape (8, 8)" in msg, msg


def _on_one_rank(rank, world_size, way):
    """`unused` takes part on rank 0 only, in every step: DDP averages it with rank 1's zeros."""
    model = Sometimes()
    kw = dict(lr=0.01, weight_decay=0.1)
    if way == "ddp":
        ddp = DDP(model, find_unused_parameters=True)
        opt = torch.optim.AdamW(ddp.parameters(), **kw)
    else:
        ddp, opt = model, gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=way, **kw)
    for step in range(STEPS):
        x, y = batch(step, rank, world_size)
        F.mse_loss(ddp(x, use=rank == 0), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2])
def test_a_parameter_used_on_one_rank_only_trains_as_ddp_with_find_unused_parameters(stage):
    """Stage 2 reduce-scattered in the backward of the rank that had every gradient and in step()
    on the other: the ranks waited in different collectives until the timeout. Now every rank
    reduce-scatters at the end of its backward."""
    ddp = gc.launch(_on_one_rank, 2, args=("ddp",), timeout=120)[0]
    assert not torch.equal(ddp["unused.weight"], Sometimes().state_dict()["unused.weight"])
    for ours in gc.launch(_on_one_rank, 2, args=(stage,), timeout=120):
        for k in ddp:                                          # 2 ranks: bit for bit
            assert torch.equal(ours[k], ddp[k]), k


# --- state_dict() without consolidate_state_dict(): torch's raises at once, so does ours ---------

def _state_dict_unconsolidated(rank, world_size, way):
    model = make_model()
    if way == "torch":
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    else:
        opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=way, lr=0.01)
    x, y = batch(0, rank, world_size)
    F.mse_loss(model(x), y).backward()
    opt.step()
    out = []
    for consolidate in (False, True):
        if consolidate:
            opt.consolidate_state_dict(to=0)
        try:
            out.append(sorted(opt.state_dict()))
        except RuntimeError as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_state_dict_without_consolidating_raises_as_zero_redundancy_optimizer(stage):
    theirs = gc.launch(_state_dict_unconsolidated, 2, args=("torch",), timeout=120)
    ours = gc.launch(_state_dict_unconsolidated, 2, args=(stage,), timeout=120)
    for rank in range(2):
        (t_before, t_after), (o_before, o_after) = theirs[rank], ours[rank]
        assert isinstance(t_before, str) and isinstance(o_before, str)          # both refuse
        assert "consolidate_state_dict(to=0)" in o_before and "shard_state_dict()" in o_before
        # after consolidating on rank 0: the whole state there, refused elsewhere — as torch's
        assert isinstance(t_after, str) == isinstance(o_after, str) == (rank != 0)
        if rank == 0:
            assert o_after == t_after == ["param_groups", "state"]


def _model_zero_grad(rank, world_size, way):
    model = make_model()
    if way == "ddp":
        model = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    else:
        opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=way, lr=0.01)
    try:
        for step in range(2):
            x, y = batch(step, rank, world_size)
            F.mse_loss(model(x), y).backward()
            opt.step()
            model.zero_grad()                    # the model's, not the optimizer's: common in scripts
    except RuntimeError as e:
        return str(e)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2])
def test_model_zero_grad_trains_as_ddp_or_is_refused(stage):
    """Stage 2 keeps the gradient in the optimizer's shard, where model.zero_grad() cannot reach: the
    next backward would add onto the last step's gradient — refused, naming opt.zero_grad()."""
    ddp = gc.launch(_model_zero_grad, 2, args=("ddp",), timeout=120)[0]
    for ours in gc.launch(_model_zero_grad, 2, args=(stage,), timeout=120):
        if stage == 1:
            assert all(torch.equal(p, q) for p, q in zip(ours, ddp))
        else:
            assert isinstance(ours, str) and "opt.zero_grad()" in ours, ours


# -- torch.amp.GradScaler: the same skipped steps and scales as DDP, on every rank ----------------

def _scaled(rank, world_size, way, inf_step=1, clip=None):
    """GradScaler on CPU with one inf in one gradient element on rank 0 only, in step ``inf_step``."""
    model = make_model()
    layer = model[4]
    if way == "ddp":
        model = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    else:
        opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=way, lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scales = []
    for step in range(STEPS):
        x, y = batch(step, rank, world_size)
        handle = None
        if rank == 0 and step == inf_step:
            handle = layer.weight.register_hook(
                lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("inf"))))
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if handle is not None:
            handle.remove()
        if clip is not None:                  # the AMP recipe: unscale, then clip, then step
            scaler.unscale_(opt)
            if way == "ddp":
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            else:
                opt.clip_grad_norm_(clip)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2])
def test_grad_scaler_skips_the_same_steps_as_ddp(stage):
    """DDP skips step 1 on both ranks (its all-reduce gives both the inf) and halves the scale.
    ZeroOptimizer's scaler used to look at each rank's own gradients — stage 1: rank 0 skipped,
    rank 1 waited in step() until the timeout; stage 2: "No inf checks were recorded" — and was
    then refused. Now the scaler sees the averaged gradients, and training equals DDP's bit for bit."""
    ddp_scales, ddp = gc.launch(_scaled, 2, args=("ddp",), timeout=120)[0]
    assert ddp_scales == [256.0, 128.0, 128.0, 128.0]                  # step 1 skipped on both ranks
    _, clean = gc.launch(_scaled, 2, args=("ddp", -1), timeout=120)[0]
    assert not all(torch.equal(a, b) for a, b in zip(ddp, clean))        # (the skip matters)
    for scales, mine in gc.launch(_scaled, 2, args=(stage,), timeout=60):
        assert scales == ddp_scales
        assert all(torch.equal(a, b) for a, b in zip(ddp, mine))


@pytest.mark.parametrize("stage", [1, 2])
def test_grad_scaler_unscale_then_clip_equals_ddp(stage):
    """``scaler.unscale_(opt)`` then ``opt.clip_grad_norm_`` — the AMP clipping recipe — clips the
    unscaled, averaged gradients, as DDP + unscale_ + torch's clip (within a rounding: the norm's
    sum runs in another order)."""
    ddp_scales, ddp = gc.launch(_scaled, 2, args=("ddp", 1, 0.05), timeout=120)[0]
    _, unclipped = gc.launch(_scaled, 2, args=("ddp", 1), timeout=120)[0]
    assert max((a - b).abs().max().item() for a, b in zip(ddp, unclipped)) > 1e-4    # (the clip acts)
    for scales, mine in gc.launch(_scaled, 2, args=(stage, 1, 0.05), timeout=60):
        assert scales == ddp_scales
        for a, b in zip(ddp, mine):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _refused(rank, world_size, optimizer_class, kwargs):
    model = make_model()
    with pytest.raises(ValueError) as caught:
        gc.ZeroOptimizer(model.parameters(), optimizer_class, stage=1 + rank, **kwargs)
    return str(caught.value)


@pytest.mark.parametrize("name, kwargs, why", [
    ("Adafactor", {"lr": 0.01}, "does not update each element on its own"),
    ("Muon", {"lr": 0.01}, "Muon only supports 2D parameters"),
    ("LBFGS", {}, "missing 1 required positional argument: 'closure'"),
])
def test_an_optimizer_that_is_not_element_wise_is_refused_at_construction(name, kwargs, why):
    """Each rank's shard is a 1-D slice across parameters. Adafactor stepped on such slices (factored
    moments, RMS-scaled steps) trained 4e-3 to 7e-3 away from DDP + Adafactor in 5 steps, with no
    error; Muon and LBFGS failed with errors about a parameter or a closure the user never passed.
    Now each is refused when the optimizer is built, on every rank, naming what to use instead."""
    optimizer_class = getattr(torch.optim, name)
    for message in gc.launch(_refused, 2, args=(optimizer_class, kwargs), timeout=120):
        assert f"ZeroOptimizer cannot shard {name}" in message and why in message, message
        assert "ZeroRedundancyOptimizer" in message, message
    # the difference is real: torch's ZeroRedundancyOptimizer (whole parameters) trains as DDP, and
    # Adafactor on slices of the same numbers does not
    if name == "Adafactor":
        whole = [nn.Parameter(torch.arange(30.0).reshape(6, 5) / 7)]
        pieces = [nn.Parameter(t.clone()) for t in whole[0].detach().reshape(-1).tensor_split([17])]
        for params, groups in ((whole, whole), (pieces, [{"params": [p]} for p in pieces])):
            opt = torch.optim.Adafactor(groups, lr=0.01)
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
        assert not torch.equal(whole[0].detach().reshape(-1), torch.cat([p.detach() for p in pieces]))


def _rebuilt(rank, world_size, first, second):
    """Three steps with one optimizer, then a new one on the same parameters (a new phase), two more."""
    model = make_model()
    net = DDP(model) if first == "ddp" else model
    make = {"ddp": lambda lr: torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1)}
    opts = []
    for phase, (way, lr, steps) in enumerate(((first, 0.01, range(3)), (second, 0.003, range(3, 5)))):
        opt = make[way](lr) if way == "ddp" else gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW,
                                                                    stage=way, lr=lr, weight_decay=0.1)
        opts.append(opt)
        for step in steps:
            x, y = batch(step, rank, world_size)
            F.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    with pytest.raises(RuntimeError, match="taken by a ZeroOptimizer built later") if first != "ddp" else \
            contextlib.nullcontext():
        opts[0].step()                            # the first one's parameters belong to the second
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("first, second", [(2, 2), (2, 1), (1, 2)])
def test_a_zero_optimizer_built_again_on_the_same_parameters_trains_as_ddp(first, second):
    """A second ZeroOptimizer on the same model (a new phase, a re-run notebook cell, a resume).
    The first one's stage-2 gradient hooks stayed on the parameters: the next backward died with
    "'NoneType' object has no attribute 'numel'" in them. Now the new optimizer takes the
    parameters (the old one's hooks go, its step() refuses), and training equals DDP + AdamW built
    again the same way, bit for bit."""
    ddp = gc.launch(_rebuilt, 2, args=("ddp", "ddp"), timeout=120)[0]
    for params in gc.launch(_rebuilt, 2, args=(first, second), timeout=120):
        for p, q in zip(params, ddp):
            assert torch.equal(p, q)


def _then_ddp(rank, world_size, first):
    """Three steps with ZeRO (gc's stage 2, or torch's), then DDP + plain AdamW: one backward's gradients."""
    model = make_model()
    if first == "torch":
        net = DDP(model)
        opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=0.01)
    else:
        net, opt = model, gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=0.01)
    for step in range(3):
        x, y = batch(step, rank, world_size)
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    if first != "torch":
        net = DDP(model)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)      # the ZeroOptimizer is dropped here
    x, y = batch(3, rank, world_size)
    F.mse_loss(net(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_dropped_stage_2_optimizer_leaves_no_hook_behind():
    """ZeroOptimizer(stage=2) for a phase, then DDP + AdamW on the same model. The dropped optimizer's
    hooks (which held it alive) still reduce-scattered the gradients and set them to None in the
    next backward: DDP then averaged zeros for the first layer's weight, in silence. The hooks hold
    the optimizer weakly now and go with it: the gradients equal those after torch's ZeRO."""
    torch_first = gc.launch(_then_ddp, 2, args=("torch",), timeout=120)
    gc_first = gc.launch(_then_ddp, 2, args=("gc",), timeout=120)
    for theirs, ours in zip(torch_first, gc_first):
        assert all(g.abs().max() > 0 for g in ours)
        for g, h in zip(theirs, ours):
            assert torch.equal(g, h)


def _batch_norm_run(rank, world_size, way):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    net, opt = (model, gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=way, lr=0.01)) \
        if way != "ddp" else (DDP(model), None)
    opt = opt or torch.optim.AdamW(net.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = batch(step, rank, world_size)
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2])
def test_batch_norm_buffers_are_each_ranks_own_where_ddp_broadcasts_rank_0s(stage):
    """The README's "differs" row: an optimizer never sees the module, so each rank keeps the running
    statistics of its own batches; DDP broadcasts rank 0's buffers before every forward. The
    parameters are DDP's bit for bit on every rank, and rank 0's buffers are DDP's too (save or
    evaluate there); rank 1's differ."""
    ddp = gc.launch(_batch_norm_run, 2, args=("ddp",), timeout=120)
    ours = gc.launch(_batch_norm_run, 2, args=(stage,), timeout=120)
    buffers = {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    for rank in range(2):
        for k, v in ddp[rank].items():
            if k not in buffers or rank == 0:
                assert torch.equal(ours[rank][k], v), (rank, k)
    assert not torch.equal(ours[1]["1.running_mean"], ddp[1]["1.running_mean"])


def _inside_a_wrapper(rank, world_size, wrapper, stage):
    """One step of ZeroOptimizer (or torch's ZeroRedundancyOptimizer, ``stage=0``) on a wrapped model:
    ``(the parameters before and after, the error step() raised or "")``."""
    model = make_model()
    net = DDP(model) if wrapper == "ddp" else gc.MiniDDP(model, bucket_cap_mb=25)
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.SGD, lr=0.1) if stage == 0 \
        else gc.ZeroOptimizer(net.parameters(), torch.optim.SGD, stage=stage, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0, rank, world_size)
    F.mse_loss(net(x), y).backward()
    error = ""
    try:
        opt.step()
    except RuntimeError as e:
        error = str(e)
    return before, [p.detach().clone() for p in model.parameters()], error


@pytest.mark.parametrize("wrapper", ["ddp", "mini_ddp"])
def test_stage_2_inside_a_ddp_wrapper_is_refused_and_stage_1_trains_as_torch(wrapper):
    """A DDP wrapper averages the gradients and writes them into ``.grad`` at the end of backward,
    after stage 2's hooks had reduced them into the shard: step() added them a second time, and
    every parameter but one moved twice as far as with torch's ZeroRedundancyOptimizer, with no error
    (found 2026-12-07). Now step() refuses on every rank before it changes anything; stage 1, whose
    average of DDP's averages is the same average, steps as torch's ZeroRedundancyOptimizer."""
    torch_zero = gc.launch(_inside_a_wrapper, 2, args=(wrapper, 0), timeout=120)
    for rank, (before, after, error) in enumerate(gc.launch(_inside_a_wrapper, 2, args=(wrapper, 2), timeout=120)):
        assert "found gradients in the model's .grad" in error and "stage=1 inside DDP" in error, (rank, error)
        assert all(torch.equal(a, b) for a, b in zip(before, after)), rank
    for (_, want, _), (_, got, error) in zip(torch_zero, gc.launch(_inside_a_wrapper, 2, args=(wrapper, 1),
                                                                     timeout=120)):
        assert error == ""
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_element_wise_optimizer_of_half_precision_parameters_is_not_refused(dtype):
    """The probe of :func:`check_element_wise` steps 1-D slices and whole matrices; in bf16 a kernel
    rounds an element in a vector's tail otherwise than in its body, and SGD + momentum was refused as
    "not element-wise" (0.002 apart). The rule is what is asked about: the probe runs in float32, and
    Adafactor is still refused."""
    from gpucourse.sharding.zero_bookkeeping import check_element_wise

    like = torch.zeros(2, dtype=dtype)
    for optimizer_class, kwargs in ((torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.AdamW, {"lr": 0.1})):
        check_element_wise(optimizer_class, kwargs, like)
    with pytest.raises(ValueError, match="cannot shard Adafactor"):
        check_element_wise(torch.optim.Adafactor, {"lr": 0.01}, like)
    for moved in gc.launch(_half_step, 2, args=(dtype,), timeout=120):
        assert moved > 0


def _half_step(rank, world_size, dtype):
    model = make_model().to(dtype)
    opt = gc.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    before = model[0].weight.detach().clone()
    x, y = batch(0, rank, world_size)
    F.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
    opt.step()
    return (model[0].weight.detach() - before).abs().max().item()
