"""Dynamic loss scaling from scratch — the algorithm behind ``torch.amp.GradScaler``.

In fp16, most activation gradients are tiny: below fp16's smallest subnormal (6e-8) they become 0
and training silently loses them. Backpropagation is linear in the loss, so multiplying the loss by
``S`` multiplies *every* gradient by ``S`` and lifts them into fp16's range. Before the optimizer
uses them, the gradients are divided by ``S`` again (in fp32, where nothing underflows).

Which ``S``? As large as possible without *overflowing* (inf/NaN). Nobody knows that value in
advance, and it drifts during training, so the scale adapts:

1) ``scale(loss)``: multiply the loss by the current scale ``S``, then ``backward()``;
2) ``unscale_(optimizer)``: multiply every gradient by ``1/S`` and note whether any is inf/NaN;
3) ``step(optimizer)``: run ``optimizer.step()`` only if all gradients are finite — otherwise
   *skip* this step (the parameters stay as they were);
4) ``update()``: after an overflow multiply ``S`` by ``backoff_factor`` (0.5); after
   ``growth_interval`` clean steps in a row multiply it by ``growth_factor`` (2.0).

:class:`LossScaler` follows ``torch.amp.GradScaler`` step for step (the same scale after every
update, bit-identical parameters); ``tests/test_loss_scaling.py`` checks that on random models with
injected inf/NaN gradients. It reads the overflow flag with ``.item()`` for clarity; GradScaler
keeps the scale and flags on the GPU so that ``unscale_`` and ``update`` need no CPU-GPU sync.
"""

from __future__ import annotations

from enum import Enum

import torch

from ..runtime import check_int, check_number

__all__ = ["LossScaler", "update_scale", "activation_gradients"]


def _to_fp32(x: float) -> float:
    """Round a Python float to the nearest float32 (overflow gives inf), as a float32 scale tensor stores it."""
    return torch.tensor(x, dtype=torch.float64).float().item()


def _check_factors(init_scale, growth_factor, backoff_factor, growth_interval) -> None:
    for name, value in (("init_scale", init_scale), ("growth_factor", growth_factor),
                        ("backoff_factor", backoff_factor)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    if not 0 < init_scale < float("inf"):
        raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
    if not growth_factor > 1.0:
        raise ValueError(f"growth_factor must be > 1.0 (the scale grows after clean steps), "
                         f"got {growth_factor!r}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1) (the scale shrinks after an overflow), "
                         f"got {backoff_factor!r}")
    check_int("growth_interval", growth_interval, 1)


def update_scale(scale: float, growth_tracker: int, found_inf: bool, *, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> tuple[float, int]:
    """One update of the dynamic loss scale: the rule of ``torch._amp_update_scale_``.

    Args:
        scale: the current scale (a float32 value).
        growth_tracker: how many clean (finite) steps in a row came before this one.
        found_inf: whether this step's gradients had an inf or NaN.
        growth_factor, backoff_factor, growth_interval: as in :class:`LossScaler`.

    Returns:
        ``(new_scale, new_growth_tracker)``. The scale is rounded to float32, as it is stored; a
        growth that would overflow float32 is not taken.

    Example::

        >>> update_scale(1024.0, 0, found_inf=True)               # overflow: back off, restart count
        (512.0, 0)
        >>> update_scale(1024.0, 5, found_inf=False, growth_interval=10)
        (1024.0, 6)
        >>> update_scale(1024.0, 9, found_inf=False, growth_interval=10)   # 10th clean step: grow
        (2048.0, 0)

    .. warning::
        The scale only grows after ``growth_interval`` *consecutive* clean steps (2000 by default),
        but halves on every overflow. A scale that keeps falling below 1 means the gradients are
        inf/NaN for a reason scaling cannot fix (a bug, a bad batch, a too-high learning rate).
    """
    check_number("scale", scale, minimum=0)          # the current loss scale: finite, not NaN
    check_int("growth_tracker", growth_tracker, 0)    # clean steps in a row
    if found_inf:
        return _to_fp32(scale * backoff_factor), 0
    successful = growth_tracker + 1
    if successful == growth_interval:
        grown = _to_fp32(scale * growth_factor)
        return (grown if grown != float("inf") else scale), 0
    return scale, successful


class _Stage(Enum):
    READY = "ready"          # nothing done for this optimizer since the last update()
    UNSCALED = "unscaled"    # unscale_() ran: gradients are true gradients, inf check recorded
    STEPPED = "stepped"      # step() ran (or was skipped): only update() may come next


def _grads_of(optimizer) -> list[torch.Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


class LossScaler:
    """Dynamic loss scaling with the ``scale / unscale_ / step / update`` protocol of ``GradScaler``.

    Args:
        init_scale: the first scale (2^16).
        growth_factor: multiply the scale by this after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiply the scale by this after an overflow (in (0, 1)).
        growth_interval: clean steps in a row before the scale grows.
        enabled: ``False`` makes every method a pass-through (``step`` just calls
            ``optimizer.step()``), so one script serves fp32, bf16 and fp16 runs.

    Example::

        >>> import torch
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = LossScaler(init_scale=2.0**10, growth_interval=2)
        >>> for _ in range(2):
        ...     opt.zero_grad()
        ...     loss = model(torch.ones(3, 4)).sum()
        ...     scaler.scale(loss).backward()      # gradients are 1024x too large ...
        ...     scaler.step(opt)                   # ... unscaled, checked, then applied
        ...     scaler.update()
        >>> scaler.get_scale()                     # two clean steps: grown once
        2048.0

    .. warning::
        Clip or inspect gradients only *after* ``unscale_(optimizer)``: before it they are ``S``
        times too large (a ``max_norm`` of 1.0 would then clip almost everything). And call
        ``unscale_`` at most once per optimizer per iteration — a second call would divide again.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__} {enabled!r}")
        _check_factors(init_scale, growth_factor, backoff_factor, growth_interval)
        self._enabled = enabled
        self._init_scale = float(init_scale)  # rounded to float32 once the scale tensor exists
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._scale: torch.Tensor | None = None      # float32, created by the first scale() on the loss's device
        self._growth_tracker = 0
        self._per_optimizer: dict[int, dict] = {}    # id(optimizer) -> {"stage", "found_inf"}

    # --- 1) scale ------------------------------------------------------------------------------
    def scale(self, outputs):
        """Multiply ``outputs`` (a loss tensor, or a list/tuple of them) by the current scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=outputs.device)
            return outputs * self._scale.to(outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"scale() takes a tensor or a list/tuple of tensors, got {type(outputs).__name__}")

    # --- 2) unscale_ ---------------------------------------------------------------------------
    def _state(self, optimizer) -> dict:
        return self._per_optimizer.setdefault(id(optimizer), {"stage": _Stage.READY, "found_inf": False})

    def _require_scale(self, method: str) -> torch.Tensor:
        if self._scale is None:
            raise RuntimeError(f"{method}() was called before scale(): there are no scaled gradients "
                               "yet. Call scaler.scale(loss).backward() earlier in the iteration.")
        return self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and record whether any is inf/NaN."""
        if not self._enabled:
            return
        scale = self._require_scale("unscale_")
        state = self._state(optimizer)
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last "
                               "update(): the gradients are already unscaled. Call it once per iteration, "
                               "between backward() and step().")
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step(). Call unscale_() before step(), "
                               "or update() first to start the next iteration.")
        # 1/S computed in float64, then rounded to float32 (what GradScaler does: exact for powers of 2)
        inv_scale = scale.double().reciprocal().float()
        found_inf = False
        grads = _grads_of(optimizer)
        with torch.no_grad():
            for grad in grads:
                if grad.dtype == torch.float16:
                    raise ValueError("unscale_() got float16 gradients: the parameters themselves are "
                                     "float16. Keep the parameters (master weights) in float32 and let "
                                     "torch.autocast run the forward pass in float16.")
                values = grad._values() if grad.is_sparse else grad
                found_inf |= not bool(torch.isfinite(values).all())   # check before multiplying
                values.mul_(inv_scale.to(values.device))
        state["found_inf"] = found_inf
        state["checked"] = bool(grads)      # GradScaler records a check only where there are grads
        state["stage"] = _Stage.UNSCALED

    # --- 3) step -------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale (unless done already), then ``optimizer.step()`` — skipped if a gradient is inf/NaN.

        Returns what ``optimizer.step`` returns, or ``None`` when the step was skipped.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("step() with a closure is not supported with loss scaling: compute the "
                               "loss, call scaler.scale(loss).backward(), then scaler.step(optimizer).")
        self._require_scale("step")
        state = self._state(optimizer)
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update(). Call "
                               "scaler.update() at the end of every iteration.")
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        if not state["checked"]:    # like GradScaler: "No inf checks were recorded for this optimizer."
            raise RuntimeError(
                "No inf checks were recorded for this optimizer: none of its parameters has a .grad. "
                "Call scaler.scale(loss).backward() before scaler.step(optimizer), and make sure the "
                "loss depends on the parameters this optimizer updates (requires_grad=True, not "
                "frozen, not detached).")
        result = None if state["found_inf"] else optimizer.step(*args, **kwargs)
        state["stage"] = _Stage.STEPPED
        return result

    # --- 4) update -----------------------------------------------------------------------------
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Adapt the scale to this iteration's overflow checks (or set ``new_scale``) and start the next."""
        if not self._enabled:
            return
        scale = self._require_scale("update")
        if new_scale is not None:
            value = new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"new_scale must be a positive number, got {new_scale!r}")
            scale.fill_(float(value))
        else:
            checked = [s for s in self._per_optimizer.values()
                       if s["stage"] is not _Stage.READY and s.get("checked")]
            if not checked:
                raise RuntimeError("update() found no inf/NaN checks in this iteration. Call "
                                   "scaler.step(optimizer) (or scaler.unscale_(optimizer)) before update(), "
                                   "on an optimizer whose parameters received gradients.")
            found_inf = any(s["found_inf"] for s in checked)
            value, self._growth_tracker = update_scale(
                scale.item(), self._growth_tracker, found_inf, growth_factor=self._growth_factor,
                backoff_factor=self._backoff_factor, growth_interval=self._growth_interval)
            scale.fill_(value)
        self._per_optimizer = {}

    # --- inspection and checkpoints -------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled)."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale.item()

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict:
        """The scaler's state, with the same keys as ``GradScaler.state_dict()`` (``{}`` when disabled)."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state from :meth:`state_dict` — ours or ``GradScaler``'s (no-op when disabled)."""
        if not self._enabled:
            return
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError("The state dict is empty, probably saved from a disabled scaler. Save "
                               "it from an enabled one, or create this scaler with enabled=False.")
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} - set(state_dict)
        if missing:
            raise ValueError(f"state_dict is missing {sorted(missing)}")
        _check_factors(state_dict["scale"], state_dict["growth_factor"], state_dict["backoff_factor"],
                       state_dict["growth_interval"])
        self._init_scale = float(state_dict["scale"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])

    def __repr__(self) -> str:
        if not self._enabled:
            return "LossScaler(enabled=False)"
        return (f"LossScaler(scale={self.get_scale():g}, growth_factor={self._growth_factor:g}, "
                f"backoff_factor={self._backoff_factor:g}, growth_interval={self._growth_interval}, "
                f"growth_tracker={self._growth_tracker})")


def activation_gradients(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                         loss_fn) -> dict[str, torch.Tensor]:
    """Gradients of the loss with respect to the output of each child module (the backward "signal").

    These are the tensors that flow through the backward pass — in fp16 autocast they *are* fp16,
    so this is where underflow happens. Parameter gradients are returned under ``"param:<name>"``.

    Args:
        model: a module whose direct children are applied in turn (any ``nn.Module`` works;
            only children that produce a tensor are recorded).
        inputs, targets: one batch.
        loss_fn: ``loss_fn(model(inputs), targets)`` gives a scalar loss.

    Example::

        >>> import torch
        >>> from gpucourse import MLP
        >>> g = activation_gradients(MLP(4, 8, 2), torch.randn(5, 4), torch.randn(5, 2),
        ...                          torch.nn.functional.mse_loss)
        >>> sorted(g)[:3], g["0"].shape                 # output of layer "0": (batch, 8)
        (['0', '1', '2'], torch.Size([5, 8]))

    .. warning::
        Gradients of a *mean* loss shrink with the batch size (each sample contributes 1/B), so
        larger batches push more of them below fp16's range.
    """
    grads: dict[str, torch.Tensor] = {}
    handles = []

    def keep(name):
        def forward_hook(module, args, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda g: grads.__setitem__(name, g.detach().clone()))
        return forward_hook

    for name, child in model.named_children():
        handles.append(child.register_forward_hook(keep(name)))
    try:
        model.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
    finally:
        for h in handles:
            h.remove()
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[f"param:{name}"] = p.grad.detach().clone()
    return grads
