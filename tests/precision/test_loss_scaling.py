"""LossScaler against torch.amp.GradScaler: same scales, same parameters, same protocol errors."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import gpucourse as gc
from gpucourse.precision.loss_scaling import update_scale


def _model(seed, sizes=(6, 12, 3)):
    torch.manual_seed(seed)
    return gc.MLP(*sizes)


def _twin(seed, optimizer="sgd"):
    """Two identical (model, optimizer) pairs: one for GradScaler, one for LossScaler."""
    a = _model(seed)
    b = copy.deepcopy(a)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=1e-2)}[optimizer]
    return (a, make(a.parameters())), (b, make(b.parameters()))


def _poison(model, kind, generator):
    """Put an inf or NaN into one random gradient element (what an fp16 overflow looks like)."""
    params = [p for p in model.parameters() if p.grad is not None]
    p = params[int(torch.randint(len(params), (1,), generator=generator))]
    i = int(torch.randint(p.grad.numel(), (1,), generator=generator))
    p.grad.view(-1)[i] = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}[kind]


def _run(model, opt, scaler, steps, poison, clip, data_seed):
    """Train with a scaler; return the scale and growth tracker after every update."""
    g = torch.Generator().manual_seed(data_seed)
    trajectory = []
    for step in range(steps):
        x = torch.randn(16, 6, generator=g)
        y = torch.randn(16, 3, generator=g)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if step in poison:
            _poison(model, poison[step], torch.Generator().manual_seed(data_seed + step))
        if clip and step % 2 == 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        trajectory.append((scaler.get_scale(), scaler.state_dict()["_growth_tracker"]))
    return trajectory


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6),
       growth_interval=st.integers(1, 4),
       growth_factor=st.sampled_from([2.0, 1.5, 3.0, 1.1]),
       backoff_factor=st.sampled_from([0.5, 0.25, 0.7, 0.9]),
       init_scale=st.sampled_from([2.0**16, 2.0**3, 1000.0, 0.3]),
       poison=st.dictionaries(st.integers(0, 11), st.sampled_from(["inf", "-inf", "nan"]), max_size=5),
       clip=st.booleans(),
       optimizer=st.sampled_from(["sgd", "adam"]))
def test_same_trajectory_and_parameters_as_gradscaler(seed, growth_interval, growth_factor, backoff_factor,
                                                      init_scale, poison, clip, optimizer):
    kw = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
              growth_interval=growth_interval)
    (ma, oa), (mb, ob) = _twin(seed, optimizer)
    ref = _run(ma, oa, torch.amp.GradScaler("cpu", **kw), 12, poison, clip, seed)
    ours = _run(mb, ob, gc.LossScaler(**kw), 12, poison, clip, seed)
    assert ours == ref
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(pa, pb)          # bit-identical, overflow steps included


def test_real_fp16_overflows_follow_gradscaler():
    """fp16 autocast on the CPU with a too-large initial scale: the backward overflows for real."""
    (ma, oa), (mb, ob) = _twin(1)
    results = []
    for model, opt, scaler in ((ma, oa, torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=3)),
                               (mb, ob, gc.LossScaler(init_scale=2.0**40, growth_interval=3))):
        g = torch.Generator().manual_seed(0)
        scales = []
        for _ in range(30):
            x, y = torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        results.append(scales)
    assert results[0] == results[1]
    assert min(results[1]) < 2.0**40          # it did back off: there were real overflows
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(pa, pb)


def test_skipped_step_leaves_parameters_and_optimizer_state_untouched():
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    scaler = gc.LossScaler(init_scale=8.0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.randn(4, 6)).sum()).backward()
    _poison(model, "nan", torch.Generator().manual_seed(0))
    assert scaler.step(opt) is None
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.state_dict()["state"] == {}    # Adam never stepped
    assert scaler.get_scale() == 4.0


def test_two_optimizers_match_gradscaler():
    """Each optimizer skips on its own overflow; update() backs off if any of them overflowed."""
    out = []
    for make in (lambda: torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=2),
                 lambda: gc.LossScaler(init_scale=64.0, growth_interval=2)):
        torch.manual_seed(3)
        a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
        scaler = make()
        for step in range(6):
            oa.zero_grad(), ob.zero_grad()
            scaler.scale(b(a(torch.randn(3, 4))).sum()).backward()
            if step == 2:
                b.weight.grad[0, 0] = float("inf")
            scaler.step(oa)
            scaler.step(ob)
            scaler.update()
            out.append(scaler.get_scale())
        out.append([p.detach().clone() for p in (*a.parameters(), *b.parameters())])
    n = len(out) // 2
    assert out[:n - 1] == out[n:-1]
    assert all(torch.equal(x, y) for x, y in zip(out[n - 1], out[-1]))


def test_disabled_scaler_is_a_pass_through_like_gradscaler():
    ref = torch.amp.GradScaler("cpu", enabled=False)
    ours = gc.LossScaler(enabled=False)
    (ma, oa), (mb, ob) = _twin(5)
    for model, opt, scaler in ((ma, oa, ref), (mb, ob, ours)):
        loss = model(torch.ones(2, 6)).sum()
        assert scaler.scale(loss) is loss
        loss.backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and not scaler.is_enabled()
        scaler.load_state_dict({})             # no-op, no error
    assert all(torch.equal(a, b) for a, b in zip(ma.parameters(), mb.parameters()))


def test_state_dict_round_trip_and_interchange_with_gradscaler():
    kw = dict(init_scale=256.0, growth_interval=3, growth_factor=4.0, backoff_factor=0.25)
    (ma, oa), (mb, ob) = _twin(7)
    ref = torch.amp.GradScaler("cpu", **kw)
    ours = gc.LossScaler(**kw)
    _run(ma, oa, ref, 5, {1: "inf"}, False, 7)
    _run(mb, ob, ours, 5, {1: "inf"}, False, 7)
    assert ours.state_dict() == ref.state_dict()
    # resume each from the other's checkpoint: both continue identically
    ours2, ref2 = gc.LossScaler(), torch.amp.GradScaler("cpu")
    ours2.load_state_dict(ref.state_dict())
    ref2.load_state_dict(ours.state_dict())
    assert _run(mb, ob, ours2, 4, {2: "nan"}, False, 9) == _run(ma, oa, ref2, 4, {2: "nan"}, False, 9)
    # a state loaded after the scale tensor exists overwrites it
    ours2.load_state_dict({**ours2.state_dict(), "scale": 8.0})
    assert ours2.get_scale() == 8.0


def test_before_first_scale_get_scale_and_state_dict_match_gradscaler():
    for init in (2.0**16, 0.1):
        assert gc.LossScaler(init_scale=init).state_dict() == torch.amp.GradScaler("cpu", init_scale=init).state_dict()


def test_update_with_new_scale():
    scaler = gc.LossScaler()
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 6)).sum()).backward()
    scaler.step(opt)
    scaler.update(new_scale=32.0)
    assert scaler.get_scale() == 32.0
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=-1.0)


def _one_backward(scaler):
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, 6)).sum()).backward()
    return model, opt


@pytest.mark.parametrize("misuse, message", [
    ("unscale_twice", r"already been called on this optimizer.*once per iteration"),
    ("unscale_after_step", r"after step\(\).*before step\(\)"),
    ("step_twice", r"step\(\) has already been called.*update\(\)"),
    ("update_without_step", r"no inf/NaN checks.*scaler.step\(optimizer\)"),
    ("step_without_scale", r"before scale\(\).*scaler.scale\(loss\).backward\(\)"),
    ("unscale_without_scale", r"before scale\(\)"),
    ("update_without_scale", r"before scale\(\)"),
    ("closure", r"closure"),
    ("load_empty", r"empty"),
])
def test_misuse_order_raises_runtime_error_with_the_fix(misuse, message):
    scaler = gc.LossScaler()
    if misuse.endswith("without_scale"):
        opt = torch.optim.SGD(_model(0).parameters(), lr=0.1)
        call = {"step_without_scale": lambda: scaler.step(opt),
                "unscale_without_scale": lambda: scaler.unscale_(opt),
                "update_without_scale": scaler.update}[misuse]
        with pytest.raises(RuntimeError, match=message):
            call()
        return
    _, opt = _one_backward(scaler)
    with pytest.raises(RuntimeError, match=message):
        if misuse == "unscale_twice":
            scaler.unscale_(opt)
            scaler.unscale_(opt)
        elif misuse == "unscale_after_step":
            scaler.step(opt)
            scaler.unscale_(opt)
        elif misuse == "step_twice":
            scaler.step(opt)
            scaler.step(opt)
        elif misuse == "update_without_step":
            scaler.update()
        elif misuse == "closure":
            scaler.step(opt, closure=lambda: 0.0)
        elif misuse == "load_empty":
            scaler.load_state_dict({})


def _no_grads(scaler, frozen):
    """A backward happened, but none of this optimizer's parameters got a .grad."""
    used, unused = _model(0), _model(1)
    opt = torch.optim.SGD(unused.parameters(), lr=0.1)
    if frozen:                       # ... or they are frozen
        unused.requires_grad_(False)
        opt = torch.optim.SGD(unused.parameters(), lr=0.1)
    scaler.scale(used(torch.ones(2, 6)).sum()).backward()
    return unused, opt


@pytest.mark.parametrize("frozen", [False, True])
def test_step_without_any_gradient_raises_like_gradscaler(frozen):
    ref = torch.amp.GradScaler("cpu")
    _, ref_opt = _no_grads(ref, frozen)
    with pytest.raises((AssertionError, RuntimeError), match="No inf checks were recorded for this optimizer"):
        ref.step(ref_opt)
    ours = gc.LossScaler()
    model, opt = _no_grads(ours, frozen)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"No inf checks were recorded for this optimizer.*"
                                           r"scaler.scale\(loss\).backward\(\)"):
        ours.step(opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # nothing stepped


def test_update_after_unscaling_no_gradients_raises_like_gradscaler():
    ref, ours = torch.amp.GradScaler("cpu"), gc.LossScaler()
    for scaler, error in ((ref, (AssertionError, RuntimeError)), (ours, RuntimeError)):
        _, opt = _no_grads(scaler, frozen=False)
        scaler.unscale_(opt)                    # no error yet, in both
        with pytest.raises(error, match="(?i)no inf.*checks"):
            scaler.update()


def test_after_update_a_new_iteration_may_unscale_again():
    scaler = gc.LossScaler()
    model, opt = _one_backward(scaler)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 6)).sum()).backward()
    scaler.unscale_(opt)                       # no error: update() started a new iteration


@pytest.mark.parametrize("kwargs, match", [
    (dict(growth_factor=1.0), "growth_factor must be > 1.0"),
    (dict(growth_factor=0.5), "growth_factor must be > 1.0"),
    (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
    (dict(backoff_factor=0.0), r"backoff_factor must be in \(0, 1\)"),
    (dict(growth_interval=0), "growth_interval must be >= 1, got 0"),
    (dict(init_scale=0.0), "init_scale must be a positive finite"),
    (dict(init_scale=float("inf")), "init_scale must be a positive finite"),
])
def test_invalid_factors_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gc.LossScaler(**kwargs)


def test_growth_interval_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="growth_interval must be an int, got float 2.5"):
        gc.LossScaler(growth_interval=2.5)


def test_wrong_types_raise_type_error():
    with pytest.raises(TypeError, match="growth_factor"):
        gc.LossScaler(growth_factor="2")
    with pytest.raises(TypeError, match="enabled"):
        gc.LossScaler(enabled=1)
    with pytest.raises(TypeError, match="tensor"):
        gc.LossScaler().scale(3.0)


def test_scale_lists_and_tuples_like_gradscaler():
    losses = [torch.tensor(1.5), (torch.tensor(2.0), torch.tensor(-3.0))]
    ours = gc.LossScaler(init_scale=4.0).scale([losses[0], losses[1]])
    assert isinstance(ours, list) and isinstance(ours[1], tuple)
    assert [ours[0].item(), ours[1][0].item(), ours[1][1].item()] == [6.0, 8.0, -12.0]


def test_fp16_parameters_are_rejected_with_the_fix():
    model = torch.nn.Linear(3, 1).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = gc.LossScaler()
    scaler.scale(model(torch.ones(2, 3, dtype=torch.float16)).float().sum()).backward()
    with pytest.raises(ValueError, match="master weights"):
        scaler.step(opt)


@settings(max_examples=60, deadline=None)
@given(scale=st.floats(1e-30, 3e38), tracker=st.integers(0, 10), growth_interval=st.integers(1, 12),
       found_inf=st.booleans(), growth_factor=st.floats(1.0001, 8.0), backoff_factor=st.floats(0.01, 0.99))
def test_update_scale_is_torchs_rule(scale, tracker, growth_interval, found_inf, growth_factor, backoff_factor):
    tracker = min(tracker, growth_interval - 1)
    s = torch.tensor(scale, dtype=torch.float32)
    t = torch.tensor(tracker, dtype=torch.int32)
    torch._amp_update_scale_(s, t, torch.tensor(float(found_inf)), growth_factor, backoff_factor, growth_interval)
    ours = update_scale(s.new_tensor(scale).item(), tracker, found_inf, growth_factor=growth_factor,
                        backoff_factor=backoff_factor, growth_interval=growth_interval)
    assert ours == (s.item(), t.item())
    assert math.isfinite(ours[0])


def test_activation_gradients_match_autograd():
    torch.manual_seed(0)
    model = gc.MLP(5, 7, 3)
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    grads = gc.activation_gradients(model, x, y, F.mse_loss)
    h = model[0](x)
    out = model[2](model[1](h))
    (gh,) = torch.autograd.grad(F.mse_loss(out, y), h)
    torch.testing.assert_close(grads["0"], gh)
    torch.testing.assert_close(grads["param:2.weight"], model[2].weight.grad)


@pytest.mark.cuda
def test_cuda_fp16_same_as_gradscaler():
    out = []
    for make in (lambda: torch.amp.GradScaler("cuda", init_scale=2.0**30, growth_interval=2),
                 lambda: gc.LossScaler(init_scale=2.0**30, growth_interval=2)):
        model = _model(0).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = make()
        g = torch.Generator().manual_seed(0)
        scales = []
        for _ in range(20):
            x, y = torch.randn(64, 6, generator=g).cuda(), torch.randn(64, 3, generator=g).cuda()
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        out.append((scales, [p.detach().cpu() for p in model.parameters()]))
    assert out[0][0] == out[1][0]
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


@pytest.mark.parametrize("scale, tracker", [(float("nan"), 0), (float("inf"), 0), (-1.0, 0), ("1", 0),
                                            (1024.0, -1), (1024.0, 1.5)])
def test_update_scale_rejects_what_is_not_a_scale(scale, tracker):
    with pytest.raises((TypeError, ValueError), match="scale must be|growth_tracker must be"):
        update_scale(scale, tracker, False)
