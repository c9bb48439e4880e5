"""ZeRO-1 and ZeRO-2 from scratch: each rank keeps and updates only its slice of the optimizer state.

DDP runs the same optimizer step on every rank, on the same averaged gradients: N copies of the
same work and of the same Adam state. ZeRO cuts the work and the state into N slices instead:

1) **one flat buffer** — every parameter becomes a view into one 1-D tensor, zero-padded to
   ``N · S`` elements (``S = ceil(Ψ / N)``), so it splits into N equal shards; rank ``r`` owns
   elements ``[r·S, (r+1)·S)`` (:func:`shard_ranges`). Its shard is a ``Parameter`` viewing that
   slice: the inner optimizer is built on it alone, so its state is ``1/N`` of the whole.
2) **reduce-scatter the gradients** — rank ``r`` receives the sum of slice ``r`` only, divided by N
   (the average DDP computes). Stage 1 does it in ``step()``: the model's full gradients stay on
   every rank until then (``4Ψ + KΨ/N``). Stage 2 does it in a hook as soon as backward has
   produced the last gradient and frees the full gradients: only the shard's gradient is kept
   (``2Ψ + (2 + K)Ψ/N``).
3) **step on the shard** — the inner optimizer (AdamW, SGD, …) updates slice ``r`` in place.
4) **all-gather the parameters** — the updated slices travel around the ring, into the flat buffer,
   so every rank's model holds all updated parameters again.

Reduce-scatter + all-gather send as much as DDP's all-reduce (which *is* those two halves), so
stages 1 and 2 cost no extra communication. The model is not wrapped in DDP: ``step()`` averages
the gradients itself, as DeepSpeed's engine does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import group_info, validate
from .collectives import _all_gather_flat, _reduce_scatter_flat, _same_on_every_rank, shard_size

__all__ = ["ZeroOptimizer", "shard_ranges"]


def shard_ranges(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every rank's shard of a flat buffer of ``numel`` elements, padded.

    All shards have ``S = ceil(numel / world_size)`` elements; the buffer is padded to
    ``world_size · S``, so the last shards may reach past ``numel`` (into the padding) or lie
    entirely inside it.

    Example::

        >>> shard_ranges(10, 4)          # padded to 12: the last shard holds 1 real element
        [(0, 3), (3, 6), (6, 9), (9, 12)]
    """
    validate.check_int("numel", numel, 0)
    validate.check_int("world_size", world_size, 1)
    s = shard_size(numel, world_size)
    return [(r * s, (r + 1) * s) for r in range(world_size)]


class ZeroOptimizer:
    """ZeRO stage 1 or 2 around any ``torch.optim`` optimizer, on an unwrapped model.

    Build it on the model's parameters on every rank, then train as with a plain optimizer:
    ``loss.backward(); opt.step(); opt.zero_grad()``. ``step()`` averages the gradients across
    ranks (reduce-scatter), updates this rank's shard with ``optimizer_class`` and all-gathers the
    parameters: after N steps the model equals DDP + ``optimizer_class`` on the same global batch.

    Args:
        params: the model's parameters (an iterable of tensors; one parameter group). At
            construction they are moved into one flat buffer (each becomes a view into it) and
            set to rank 0's values, as DDP does.
        optimizer_class: e.g. ``torch.optim.AdamW``; it is built on this rank's shard only.
        stage: 1 (optimizer state sharded) or 2 (gradients too).
        group: the process group (default: the default group).
        **optimizer_kwargs: passed to ``optimizer_class`` (``lr=…``, ``weight_decay=…``).

    Example::

        >>> import torch, gpucourse as gc
        >>> def train(rank, world_size):
        ...     torch.manual_seed(0)
        ...     model = torch.nn.Linear(4, 3)
        ...     opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=0.1)
        ...     x = torch.randn(6, 4)[rank::world_size]          # this rank's half of the batch
        ...     model(x).square().mean().backward()
        ...     opt.step(); opt.zero_grad()
        ...     return opt.shard.numel(), model.weight.sum().item()
        >>> (s0, w0), (s1, w1) = gc.launch(train, 2)
        >>> s0, s1, w0 == w1                                    # 15 values padded to 2 x 8
        (8, 8, True)

    .. warning::
        The parameters become views into the flat buffer. Assigning ``p.data = …`` (or moving the
        model with ``.to()``) afterwards detaches them from it, and the updates no longer reach the
        model. In stage 1 their ``.grad`` are views into a flat gradient buffer that ``step()``
        reduce-scatters in place: read (or clip) gradients before ``step()``, not after.
        Every rank must call ``step()`` — it holds two collectives. In stage 2 every
        parameter must get a gradient in each backward (as in DDP without
        ``find_unused_parameters``); one that does not is reduced, as zeros, at ``step()`` — and,
        unlike ``torch.optim``, which skips a parameter whose ``.grad`` is ``None``, the shard is
        updated with that zero gradient (momentum and weight decay still act on it).
    """

    def __init__(self, params, optimizer_class, *, stage: int = 1, group=None, **optimizer_kwargs):
        validate.check_choice("stage", stage, (1, 2))
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass such as "
                            f"torch.optim.AdamW, got {optimizer_class!r}")
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors (model.parameters()), got one tensor")
        self.params = list(params)
        for i, p in enumerate(self.params):
            if isinstance(p, dict):
                raise TypeError("params: parameter groups (dicts) are not supported; pass model.parameters()")
            validate.check_tensor(f"params[{i}]", p, floating=True)
        if not self.params:
            raise ValueError("params is empty: the model has no parameters to optimize")
        frozen = [i for i, p in enumerate(self.params) if not p.requires_grad]
        if frozen:
            raise ValueError(f"params {frozen} do not require grad; pass only trainable parameters: "
                             "[p for p in model.parameters() if p.requires_grad]")
        first = self.params[0]
        if any(p.dtype != first.dtype or p.device != first.device for p in self.params):
            raise ValueError("params must all have one dtype and device, got "
                             f"{sorted({(str(p.dtype), str(p.device)) for p in self.params})}")
        self.stage, self.group = stage, group
        self.rank, self.world_size, self._global_rank = group_info(group)
        # every rank must describe the same model, or the shards would not line up (no hang: a
        # small all-gather of the shapes first, then the same ValueError on every rank)
        _same_on_every_rank("the parameters' shapes", [tuple(p.shape) for p in self.params], group)

        # 1) the flat buffer: (N·S,) — every parameter a view into it, padding at the end
        self.numel = sum(p.numel() for p in self.params)
        self.ranges = shard_ranges(self.numel, self.world_size)
        self.flat = torch.zeros(self.ranges[-1][1], dtype=first.dtype, device=first.device)
        self.offsets, offset = [], 0
        for p in self.params:
            self.flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            self.offsets.append(offset)
            offset += p.numel()
        if self.world_size > 1:
            dist.broadcast(self.flat, self._global_rank(0), group=group)     # DDP's identical start
        # this rank's shard: a Parameter viewing flat[r·S : (r+1)·S]; the optimizer sees only it
        start, end = self.ranges[self.rank]
        self.shard = nn.Parameter(self.flat[start:end])
        self.optimizer = optimizer_class([self.shard], **optimizer_kwargs)
        self._ready: set[int] = set()
        self._grads = None
        self._hooks = []
        if stage == 2:
            self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]

    # -- 2) gradients: reduce-scatter, keep this rank's slice, divided by N -----------------------
    def _reduce_gradients(self) -> None:
        # stage 1 keeps full gradients anyway: one flat buffer that backward accumulates into
        # directly (the parameters' .grad are views into it, as DDP's gradient_as_bucket_view);
        # stage 2 builds the buffer for the reduce-scatter and drops it right after.
        grads = self._grads if self._grads is not None else torch.zeros_like(self.flat)  # (N·S,)
        for p, offset in zip(self.params, self.offsets):
            view = grads[offset:offset + p.numel()].view_as(p)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            if self.stage == 1:
                p.grad = view
        if self.stage == 1:
            self._grads = grads
        mine = _reduce_scatter_flat(grads, self.group).div_(self.world_size)   # (S,) averaged
        if self.stage == 1:
            self.shard.grad = mine                # a view into the buffer: no copy
        elif self.shard.grad is None:
            self.shard.grad = mine.clone()
        else:                                     # stage 2 with gradient accumulation: add up
            self.shard.grad.add_(mine)
        if self.stage == 2:                       # keep only the shard's gradient
            for p in self.params:
                p.grad = None
        self._ready.clear()

    def _grad_ready(self, param) -> None:
        self._ready.add(id(param))
        if len(self._ready) == len(self.params):  # the last gradient of this backward arrived
            self._reduce_gradients()

    # -- the step: 2) average gradients, 3) update my shard, 4) all-gather parameters -------------
    @torch.no_grad()
    def step(self, closure=None):
        """Average the gradients, update this rank's shard, all-gather the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.stage == 1 or self._ready:      # stage 2: only a backward that missed a parameter
            if any(p.grad is not None for p in self.params):
                self._reduce_gradients()
        self.optimizer.step()
        _all_gather_flat(self.flat, self.group)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the model's gradients and the shard's gradient.

        In stage 1 the model's gradients are views into one flat buffer: it is zeroed and kept
        (``set_to_none`` is ignored for them), so the next backward accumulates straight into it.
        """
        self.shard.grad = None
        if self._grads is not None:               # stage 1
            self._grads.zero_()
            return
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @property
    def param_groups(self):
        """The inner optimizer's parameter groups (change ``lr`` here; the only parameter is the shard)."""
        return self.optimizer.param_groups

    @property
    def state(self):
        """The inner optimizer's state: this rank's slice only."""
        return self.optimizer.state

    # -- checkpoints: consolidated like torch.optim's, re-sharded on load --------------------------
    def state_dict(self) -> dict:
        """The whole optimizer state, in ``torch.optim``'s format, on every rank (a collective).

        Per-element state (Adam's ``exp_avg``, SGD's ``momentum_buffer``) is all-gathered and cut
        back into one tensor per parameter, so the result can be loaded by a ``ZeroOptimizer`` on
        any number of ranks — or by the plain optimizer on the unsharded model.
        """
        inner = self.optimizer.state_dict()
        shard_state = inner["state"].get(0, {})
        state = {i: {} for i in range(len(self.params))} if shard_state else {}
        for key, value in sorted(shard_state.items()):
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == self.shard.numel():
                full = torch.empty(self.flat.numel(), dtype=value.dtype, device=value.device)
                full.view(self.world_size, -1)[self.rank].copy_(value)
                _all_gather_flat(full, self.group)
                for i, (p, offset) in enumerate(zip(self.params, self.offsets)):
                    state[i][key] = full[offset:offset + p.numel()].view_as(p).clone()
            else:                                  # e.g. Adam's step counter: the same on every rank
                for i in state:
                    state[i][key] = value.clone() if isinstance(value, torch.Tensor) else value
        groups = [{**g, "params": list(range(len(self.params)))} for g in inner["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state from :meth:`state_dict` (saved on any number of ranks) and keep this rank's slice."""
        validate.check_type("state_dict", state_dict, dict)
        groups = state_dict.get("param_groups")
        if (not isinstance(groups, list) or len(groups) != 1
                or len(groups[0].get("params", ())) != len(self.params)):
            raise ValueError(f"state_dict must hold one parameter group with {len(self.params)} parameters "
                             "(as ZeroOptimizer.state_dict() or the plain optimizer's state_dict() on the "
                             "same model returns)")
        ids = groups[0]["params"]
        full_state = state_dict.get("state", {})
        shard_state = {}
        if full_state:
            start, end = self.ranges[self.rank]
            for key, value in full_state[ids[0]].items():
                per_element = key != "step" and all(
                    isinstance(full_state[pid].get(key), torch.Tensor)
                    and full_state[pid][key].shape == p.shape
                    for p, pid in zip(self.params, ids))
                if per_element:
                    flat = torch.zeros(self.flat.numel(), dtype=value.dtype)
                    for p, offset, pid in zip(self.params, self.offsets, ids):
                        flat[offset:offset + p.numel()] = full_state[pid][key].reshape(-1)
                    shard_state[key] = flat[start:end].clone()
                else:
                    shard_state[key] = value
        self.optimizer.load_state_dict({"state": {0: shard_state} if shard_state else {},
                                        "param_groups": [{**groups[0], "params": [0]}]})
