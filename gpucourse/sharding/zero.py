"""ZeRO-1 and ZeRO-2 from scratch: each rank keeps and updates only its slice of the optimizer state.

DDP runs the same optimizer step on every rank, on the same averaged gradients: N copies of the
same work and of the same Adam state. ZeRO cuts the work and the state into N slices instead:

1) **one flat buffer** — every trainable parameter becomes a view into one 1-D tensor, zero-padded
   to ``N · S`` elements (``S = ceil(Ψ / N)``), so it splits into N equal shards; rank ``r`` owns
   elements ``[r·S, (r+1)·S)`` (:func:`shard_ranges`). The inner optimizer is built on that slice
   alone, so its state is ``1/N`` of the whole.
2) **reduce-scatter the gradients** — rank ``r`` receives the sum of slice ``r`` only and divides
   it by N once (the average DDP computes). Stage 1 does it in ``step()``: the model's full
   gradients stay on every rank until then (``4Ψ + KΨ/N``). Stage 2 does it in a hook as soon as
   backward has produced the last gradient and frees the full gradients: only the shard's gradient
   is kept (``2Ψ + (2 + K)Ψ/N``).
3) **step on the shard** — the inner optimizer (AdamW, SGD, …) updates slice ``r`` in place.
4) **all-gather the parameters** — the updated slices travel around the ring, into the flat buffer,
   so every rank's model holds all updated parameters again.

Reduce-scatter + all-gather send as much as DDP's all-reduce (which *is* those two halves), so
stages 1 and 2 cost no extra communication. The model is not wrapped in DDP: ``step()`` averages
the gradients itself, as DeepSpeed's engine does.

**A drop-in optimizer.** :class:`ZeroOptimizer` is a ``torch.optim.Optimizer``: parameter groups
with their own options, frozen parameters, learning-rate schedulers, ``add_param_group`` and
checkpoints work as with ``torch.optim``. The groups are laid out one after another in the flat
buffer, so a rank's slice holds one piece of each group, and the inner optimizer gets one group
per piece (the bookkeeping lives in ``zero_bookkeeping.py``).

**Sum, then divide once.** Each rank's slice is the sum over ranks, divided by N once. Torch's DDP
(measured, torch 2.14) multiplies every gradient by ``1/N`` first and then sums. With N = 2 (or
any power of two) scaling by ``1/N`` is exact, so both orders give the same bits, and 2 ranks
train *bit for bit* like DDP + the same optimizer (tested). With N = 3 the two roundings differ by
up to one unit in the last place per step. Neither equals one process on the whole batch bit for
bit: that process sums the batch inside one matmul kernel, data parallelism adds per-rank partial
sums — measured here a few units in the last place of the gradients (1e-8 to 4e-7 on values of
order 1), which 3 AdamW steps carry to at most ~4e-7 on the parameters (the tests allow
``atol=1e-6, rtol=1e-5``).
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import EndOfBackward, group_info, same_on_every_rank, validate
from . import zero_bookkeeping as books
from .collectives import _all_gather_flat, _reduce_scatter_flat, shard_size

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


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 or 2 around any element-wise ``torch.optim`` optimizer, on an unwrapped model.

    Build it on the model's parameters on every rank, then train as with a plain optimizer:
    ``loss.backward(); opt.step(); opt.zero_grad()``. ``step()`` averages the gradients across
    ranks (reduce-scatter), updates this rank's shard with ``optimizer_class`` and all-gathers the
    parameters: after N steps the model equals DDP + ``optimizer_class`` on the same global batch
    (bit for bit on 2 ranks; see the module docstring for why, and the tolerance elsewhere).

    It is a ``torch.optim.Optimizer``: ``param_groups`` hold the model's parameters with their
    options, so learning-rate schedulers, per-group options and ``add_param_group`` work as usual.

    Args:
        params: the model's parameters, or parameter groups
            (``[{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]``).
            At construction the trainable ones are moved into one flat buffer (each becomes a view
            into it) and set to rank 0's values, as DDP does; frozen ones (``requires_grad=False``)
            are only set to rank 0's values, and never updated.
        optimizer_class: e.g. ``torch.optim.AdamW``; it is built on this rank's shard only.
        stage: 1 (optimizer state sharded) or 2 (gradients too).
        group: the process group (default: the default group); ``process_group=`` (its name in
            ``ZeroRedundancyOptimizer``, also positional after ``optimizer_class``) is the same.
        parameters_as_bucket_view: accepted, ``True`` or ``False``: the parameters are always
            views into one flat buffer here (what ``True`` asks of ``ZeroRedundancyOptimizer``).
        overlap_with_ddp: ``True`` raises ``NotImplementedError`` (no DDP comm hook here).
        **optimizer_kwargs: the defaults of every group, passed to ``optimizer_class``
            (``lr=…``, ``weight_decay=…``).

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
        >>> def schedule(rank, world_size):                     # groups + a scheduler, as torch.optim
        ...     model = torch.nn.Linear(4, 3)
        ...     groups = [{"params": [model.weight], "weight_decay": 0.1},
        ...               {"params": [model.bias], "weight_decay": 0.0}]
        ...     opt = gc.ZeroOptimizer(groups, torch.optim.AdamW, lr=0.1)
        ...     sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        ...     model(torch.ones(2, 4)).sum().backward()
        ...     opt.step(); sched.step()
        ...     return isinstance(opt, torch.optim.Optimizer), [g["lr"] for g in opt.param_groups]
        >>> gc.launch(schedule, 2)[0]
        (True, [0.05, 0.05])

    .. warning::
        The parameters become views into the flat buffer. Assigning ``p.data = …`` (or moving the
        model with ``.to()``) afterwards detaches them from it, and the updates no longer reach the
        model. Until ``step()`` each rank holds its *own, un-averaged* gradients (stage 1) or none
        at all (stage 2, where backward keeps only the averaged shard): to clip, call
        :meth:`clip_grad_norm_` (the global norm of the averaged gradients, as DDP +
        ``torch.nn.utils.clip_grad_norm_``) or :meth:`clip_grad_value_`. PyTorch's
        ``clip_grad_norm_`` / ``clip_grad_value_`` / ``clip_grads_with_norm_`` on the model's
        parameters would clip each rank by its own gradients, or see none (stage 2): they raise at
        the call, naming the right one, even when imported before the optimizer was built; a
        per-rank clip written by hand is refused at ``step()`` (gradients scaled since backward
        by factors that differ between the ranks).
        After ``step()`` (or :meth:`clip_grad_norm_`) the model's ``.grad`` in stage 1 hold partial
        sums of the reduce-scatter, not gradients. Every rank must call ``step()`` — it holds
        collectives — and ``clip_grad_norm_``, ``add_param_group`` and ``consolidate_state_dict``.
        A parameter that no rank has a gradient for is left as it is, as ``torch.optim`` skips a
        parameter whose ``.grad`` is ``None`` (no weight decay, no momentum); but a parameter must
        have a gradient (on some rank) in every step or in none — one used in some steps and not
        in others makes ``step()`` raise, because each group's slice is updated as one tensor with
        one step count. In stage 2 a parameter must get a gradient on every rank or on none (as in
        DDP without ``find_unused_parameters``): a rank that got all its gradients reduce-scatters
        during backward, one that missed a parameter only at ``step()``, and their collectives no
        longer pair up. In stage 2 call ``opt.zero_grad()`` (not ``model.zero_grad()``) after
        ``step()``: the gradients live in the shard (a backward onto an old one raises).
        ``state_dict()`` needs ``consolidate_state_dict(to=…)`` first, as
        ``ZeroRedundancyOptimizer``'s; :meth:`shard_state_dict` is this rank's slice. The state is
        sliced element by element: an optimizer that is not element-wise (Adafactor, LAMB's trust
        ratio, Muon, LBFGS) is refused at construction, after a two-step probe on small matrices.
        Freezing or unfreezing a parameter after construction raises at the next ``step()``. A
        ZeroOptimizer built later on the same parameters takes them over: the earlier one's
        ``step()`` then raises, and its gradient hooks are gone (they also go with the optimizer).
        Buffers are not the optimizer's: BatchNorm's running statistics stay each rank's own, where
        DDP broadcasts rank 0's before every forward (rank 0's equal DDP's: save and evaluate there).
        fp16 loss scaling (``torch.amp.GradScaler``) works as with DDP: ``scaler.unscale_(opt)``
        (or ``scaler.step(opt)``) averages the gradients first, unscales this rank's slice and
        finds inf or nan in it, and the ranks agree (one all-reduce) — so every rank skips the
        same steps and keeps the same scale, bit for bit with DDP + GradScaler.
    """

    def __init__(self, params, optimizer_class, process_group=None, parameters_as_bucket_view: bool = False,
                 overlap_with_ddp: bool = False, *, stage: int = 1, group=None, **optimizer_kwargs):
        # ZeroRedundancyOptimizer's own arguments, never passed on to the inner optimizer
        if process_group is not None:
            if group is not None and group is not process_group:
                raise TypeError("pass the group once: process_group= (ZeroRedundancyOptimizer's name) "
                                "or group=, not both")
            group = process_group
        # parameters_as_bucket_view: accepted either way — ZeroOptimizer always keeps the parameters
        # as views into one flat buffer (what True asks for); the arithmetic is the same
        validate.check_type("parameters_as_bucket_view", parameters_as_bucket_view, bool)
        if overlap_with_ddp:
            raise NotImplementedError("ZeroOptimizer does not implement overlap_with_ddp=True (the step "
                                      "inside DDP's comm hook): it averages the gradients itself in "
                                      "step(); train the plain model (no DDP wrapper) with it")
        validate.check_choice("stage", stage, (1, 2))
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass such as "
                            f"torch.optim.AdamW, got {optimizer_class!r}")
        self._built = False
        self._seen: dict[int, int] = {}                   # id(param) -> its group, for add_param_group
        # torch.optim's bookkeeping: self.param_groups holds the model's parameters and options
        super().__init__(books.param_groups_of(params), optimizer_kwargs)
        books.check_element_wise(optimizer_class, optimizer_kwargs, books.check_trainable(self.param_groups)[0])
        self.optimizer_class, self.stage, self.group = optimizer_class, stage, group
        self.rank, self.world_size, self._global_rank = group_info(group)
        self._hooks: dict[int, torch.utils.hooks.RemovableHandle] = {}   # id(param) -> its gradient hook
        self._retired = False                     # a later ZeroOptimizer took these parameters
        self._written: dict[int, torch.Tensor] = {}   # id(param) -> its gradient's 1st element after backward
        self._got_grad: set[int] = set()          # stage 2: id(param) of those that got a gradient
        self._used: dict[int, bool] = {}          # id(param) -> had a gradient (on some rank) in every step
        self._averaged = False                    # clip_grad_norm_ already averaged this step's gradients
        self._stepped = False                     # stage 2: step() ran and zero_grad() did not yet
        self._reduced = False                     # stage 2: a backward was reduced into the shard since step()
        self._end = EndOfBackward(_weakly(self, ZeroOptimizer._end_of_backward))   # stage 2: each backward's end
        self._last_used: list[bool] | None = None
        self._build()
        weakref.finalize(self, _remove_all, self._hooks)     # the hooks go with the optimizer
        self._built = True
        _LIVE.add(self)
        _guard_torch_clipping()
        _support_grad_scaler()

    def _build(self) -> None:
        """1) the flat buffer, this rank's shard, and the inner optimizer on its pieces."""
        groups = self.param_groups
        first = books.check_trainable(groups)[0]
        # every rank must describe the same model, or the shards would not line up (no hang: a
        # small all-gather of the shapes first, then the same ValueError on every rank)
        same_on_every_rank("the parameters' shapes", [[(tuple(p.shape), p.requires_grad) for p in g["params"]]
                                                       for g in groups], self.group)

        # the flat buffer: (N·S,) — every trainable parameter a view into it, group after group
        self.layout = books.FlatLayout.of(groups, self.world_size)
        self.params, self.offsets = self.layout.params, self.layout.offsets
        self.numel, self.ranges = self.layout.numel, self.layout.ranges
        self.flat = torch.zeros(self.ranges[-1][1], dtype=first.dtype, device=first.device)
        for p, offset in zip(self.params, self.offsets):
            self.flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
        if self.world_size > 1:                   # DDP's identical start, frozen parameters too
            dist.broadcast(self.flat, self._global_rank(0), group=self.group)
            for p in (p for g in groups for p in g["params"] if not p.requires_grad):
                _broadcast_in_place(p, self._global_rank(0), self.group)
        # this rank's shard: flat[r·S : (r+1)·S]; the inner optimizer sees one piece per group
        start, end = self.ranges[self.rank]
        self.shard = nn.Parameter(self.flat[start:end])
        self._pieces = []                         # (piece Parameter or None, [lo, hi) inside the shard)
        for g in range(len(groups)):
            lo, hi = self.layout.piece(g, self.rank)
            self._pieces.append((nn.Parameter(self.flat[lo:hi]) if hi > lo else None, (lo - start, hi - start)))
        self.optimizer = self.optimizer_class(
            [{**books.options(g), "params": [] if piece is None else [piece]}
             for g, (piece, _) in zip(groups, self._pieces)], **self.defaults)
        books.sync_options(self.optimizer.param_groups, groups)     # show the class defaults too
        self.state = self.optimizer.state         # this rank's slice only
        self._trainable = [p.requires_grad for g in groups for p in g["params"]]
        self._ready: set[int] = set()
        self._grads = None
        self._consolidated = None
        self._group_of = [next(g for g, (lo, hi) in enumerate(self.layout.group_ranges) if lo <= off < hi)
                          for off in self.offsets]
        # every backward: record what it wrote (stage 2: reduce). The hooks hold this optimizer weakly
        # and go when it does, or when a later ZeroOptimizer takes the parameters: a stage-2 hook left
        # behind reduced and dropped the gradients the next optimizer needed (DDP then averaged zeros).
        mine = {id(p) for p in self.params}
        for older in [o for o in list(_LIVE) if o is not self and mine & {id(p) for p in o.params}]:
            older._retire()
        for p in self.params:
            if id(p) not in self._hooks:
                self._hooks[id(p)] = p.register_post_accumulate_grad_hook(
                    _weakly(self, ZeroOptimizer._grad_ready))

    def _retire(self) -> None:
        """A ZeroOptimizer built later on (some of) these parameters made them views into its own flat
        buffer: this one's updates would no longer reach the model, and its hooks would reduce and drop
        the gradients the new one needs. Unhook, and refuse from now on."""
        _remove_all(self._hooks)
        self._retired = True
        _LIVE.discard(self)

    def _check_not_retired(self) -> None:
        if self._retired:
            raise RuntimeError("this ZeroOptimizer's parameters were taken by a ZeroOptimizer built later on "
                               "them (they are views into its flat buffer now): step that one, or load this "
                               "one's state_dict into it; this one would update a buffer the model no "
                               "longer reads")

    # -- 2) gradients: reduce-scatter, keep this rank's slice, divided by N -----------------------
    def _reduce_gradients(self) -> None:
        # stage 1 keeps full gradients anyway: one flat buffer that backward accumulates into
        # directly (the parameters' .grad are views into it, as DDP's gradient_as_bucket_view);
        # stage 2 builds the buffer for the reduce-scatter and drops it right after.
        if self.stage == 2 and self._stepped and self.shard.grad is not None:
            raise RuntimeError(
                "ZeroOptimizer(stage=2): a backward after step() found the shard's gradient of the last "
                "step still there, and would add to it. Call opt.zero_grad() after opt.step(): in stage 2 "
                "the gradients live in the optimizer's shard, which model.zero_grad() cannot reach.")
        grads = self._grads if self._grads is not None else torch.zeros_like(self.flat)  # (N·S,)
        for p, offset in zip(self.params, self.offsets):
            view = grads[offset:offset + p.numel()].view_as(p)
            if p.grad is None:                    # (stays None, as in torch: step() skips the parameter
                view.zero_()                      #  if no rank has a gradient for it)
            else:
                if self.stage == 2:
                    self._got_grad.add(id(p))
                if p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                if self.stage == 1:
                    p.grad = view
        self._written.clear()
        if self.stage == 1:
            self._grads = grads
        mine = _reduce_scatter_flat(grads, self.group).div_(self.world_size)   # (S,) sum, then / N
        if self.stage == 1:
            self.shard.grad = mine                # a view into the buffer: no copy
        elif self.shard.grad is None:
            self.shard.grad = mine.clone()
        else:                                     # stage 2 with gradient accumulation: add up
            self.shard.grad.add_(mine)
        if self.stage == 2:                       # keep only the shard's gradient
            for p in self.params:
                p.grad = None
            self._reduced = True
        self._ready.clear()

    def _grad_ready(self, param) -> None:
        # one element of what backward wrote, to tell at step() whether the gradients were scaled
        # since (torch.nn.utils.clip_grad_norm_ would clip by this rank's own norm, before the average)
        if param.grad.numel():
            self._written[id(param)] = param.grad.detach().reshape(-1)[:1].clone()
        if self.stage == 1:
            return
        self._got_grad.add(id(param))
        self._end.arm()                           # once per backward, at the outermost one's end
        self._ready.add(id(param))
        if len(self._ready) == len(self.params):  # the last gradient of this backward arrived
            self._reduce_gradients()

    def _end_of_backward(self) -> None:
        """Stage 2, at the end of every backward: where some parameter got no gradient on this rank,
        reduce-scatter now (zeros for it), as the ranks that had every gradient did in their last
        hook — so every rank reduces once per backward, whichever parameters it used. (It waited for
        step() before, where a parameter used on some ranks only left the ranks in different
        collectives until the timeout.)"""
        if self._ready:
            self._reduce_gradients()

    def _scaled_since_backward(self) -> float:
        """The factor this rank's gradients were all multiplied by since backward wrote them (1.0: none).

        ``torch.nn.utils.clip_grad_norm_`` multiplies every gradient of a rank by one factor, its own;
        a change that is not one factor for all (a tied weight's gradient all-reduced over another
        group) is not a clip and counts as 1.0. Read from one element per parameter.
        """
        pairs = [(self._written[id(p)], p.grad.detach().reshape(-1)[:1]) for p in self.params
                 if p.grad is not None and id(p) in self._written]
        if not pairs:
            return 1.0
        before = torch.cat([b for b, _ in pairs]).double()
        now = torch.cat([n for _, n in pairs]).double()
        ratios = (now[before != 0] / before[before != 0])
        ratios = ratios[ratios.isfinite()]
        if not ratios.numel():
            return 1.0
        lo, hi = ratios.min().item(), ratios.max().item()
        return hi if abs(hi - lo) <= 1e-5 * max(abs(hi), abs(lo)) else 1.0

    def _finish_gradients(self) -> list[bool] | None:
        """Average this step's gradients into the shard (once: by clip_grad_norm_ or by step()).

        Agrees with the other ranks (one small all-reduce) on which parameters got a gradient on
        some rank — ``torch.optim`` skips a parameter whose ``.grad`` is ``None``, and so must
        step() — and on the factor each rank's gradients were scaled by since backward (refused if
        the factors differ: a per-rank clip). Returns, per
        parameter, whether some rank had a gradient for it (``None``: no gradient anywhere).
        """
        if self._averaged:
            return self._last_used
        self._check_trainable_unchanged()
        if self.stage == 1:
            has = [p.grad is not None for p in self.params]
        else:
            has = [id(p) in self._got_grad or p.grad is not None for p in self.params]
        factor = self._scaled_since_backward()
        # stage 2: gradients in the model's .grad after backward's hooks reduced them all into the
        # shard (and set .grad to None) were written by someone else since: a DDP wrapper's average
        late = self.stage == 2 and self._reduced and not self._ready and any(p.grad is not None for p in self.params)
        flags = torch.tensor([float(h) for h in has] + [float(late), factor, -factor], dtype=torch.float64,
                             device=self.flat.device)
        if self.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        *used, late, hi, lo = flags.tolist()
        used, lo = [bool(u) for u in used], -lo
        if late:
            raise RuntimeError(
                "ZeroOptimizer(stage=2).step() found gradients in the model's .grad (on some rank) that were "
                "written after backward had reduced this step's gradients into the optimizer's shard and set "
                ".grad to None: a DDP wrapper (torch's DistributedDataParallel, gc.MiniDDP with buckets) "
                "averages the gradients itself and writes them back at the end of backward, and adding them "
                "too would count every gradient twice. ZeroOptimizer averages the gradients itself: use it on "
                "the unwrapped model, or stage=1 inside DDP (as torch's ZeroRedundancyOptimizer).")
        if hi - lo > 1e-5 * max(abs(hi), abs(lo)):
            raise RuntimeError(
                f"the gradients were scaled between backward() and ZeroOptimizer's step() by factors from "
                f"{lo:.6g} to {hi:.6g} on the ranks (this rank: {factor:.6g}). ZeroOptimizer averages the "
                "gradients over the ranks inside step(), so until then each rank holds its own un-averaged "
                "gradients: torch.nn.utils.clip_grad_norm_(model.parameters(), …) clips each rank by its "
                "own norm and would train differently from DDP. Clip with opt.clip_grad_norm_(max_norm) instead "
                "(the global norm of the averaged gradients, as FSDP's clip_grad_norm_).")
        self._last_used = used if any(used) else None
        if self._last_used is None:               # no gradient anywhere: step() changes nothing
            return None
        was = {i: self._used[id(p)] for i, p in enumerate(self.params) if id(p) in self._used}
        flipped = [i for i, u in was.items() if u != used[i]]
        if flipped:
            i = flipped[0]
            g = self._group_of[i]
            k = next(j for j, q in enumerate(q for q in self.param_groups[g]["params"] if q.requires_grad)
                     if q is self.params[i])
            now = "got a gradient" if used[i] else "got no gradient on any rank"
            raise RuntimeError(
                f"trainable parameter {i} (param_groups[{g}], trainable parameter {k}, shape "
                f"{tuple(self.params[i].shape)}) {now} in this step, unlike in the earlier ones "
                f"({len(flipped)} such parameter(s)). torch.optim skips a parameter whose .grad is None and "
                "keeps a step count per parameter; ZeroOptimizer updates each group's slice as one tensor, "
                "with one step count, so it cannot skip a parameter in some steps and not in others without "
                "training differently. Use every trainable parameter in every step (on some rank), or freeze "
                "the ones you do not train (requires_grad_(False) before building the optimizer) and add "
                "them later with add_param_group().")
        for i, p in enumerate(self.params):
            self._used[id(p)] = used[i]
        if self.stage == 1 or self._ready or any(p.grad is not None for p in self.params):
            self._reduce_gradients()
        return used

    # -- the step: 2) average gradients, 3) update my shard, 4) all-gather parameters -------------
    @torch.no_grad()
    def step(self, closure=None):
        """Average the gradients, update this rank's shard, all-gather the parameters."""
        self._check_not_retired()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        used = self._finish_gradients()           # stage 2: reduced already, unless a parameter missed
        self._averaged = False
        for piece, (lo, hi) in self._pieces:      # each group's piece sees its slice of the gradient
            if piece is not None:
                piece.grad = None if used is None or self.shard.grad is None else self.shard.grad[lo:hi]
        books.sync_options(self.param_groups, self.optimizer.param_groups)   # lr from a scheduler
        kept = self._keep_unused(used)
        self.optimizer.step()
        self._restore_unused(kept)
        _all_gather_flat(self.flat, self.group)
        self._consolidated = None
        self._stepped, self._reduced = True, False
        return loss

    def _keep_unused(self, used: list[bool] | None) -> list:
        """This rank's slices of the parameters no rank had a gradient for, and of their state.

        ``torch.optim`` leaves such a parameter as it is (no weight decay, no momentum); the inner
        optimizer updates a whole piece, so step() puts the slices back afterwards.
        """
        if used is None or all(used):
            return []
        start = self.ranges[self.rank][0]
        kept = []
        for i, (p, offset) in enumerate(zip(self.params, self.offsets)):
            a, b = max(offset, start), min(offset + p.numel(), self.ranges[self.rank][1])
            if used[i] or a >= b:
                continue
            piece, (lo, _) = self._pieces[self._group_of[i]]
            state = {k: v[a - start - lo:b - start - lo].clone()
                     for k, v in self.optimizer.state.get(piece, {}).items() if _per_element(v, piece)}
            kept.append((piece, a - start, b - start, lo, self.shard[a - start:b - start].clone(), state))
        return kept

    def _restore_unused(self, kept: list) -> None:
        for piece, a, b, lo, values, state in kept:
            self.shard[a:b] = values
            for k, v in self.optimizer.state.get(piece, {}).items():
                if _per_element(v, piece):        # a state born in this step: as if never touched
                    v[a - lo:b - lo] = state[k] if k in state else 0

    @torch.no_grad()
    def _average_now(self) -> None:
        """Average this step's gradients into the shard before ``step()`` (clipping, GradScaler's
        unscale), which then steps on them as they are."""
        self._check_not_retired()
        self._finish_gradients()
        self._averaged = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their global norm; returns that norm (before clipping).

        The ZeroOptimizer counterpart of ``torch.nn.utils.clip_grad_norm_`` on a DDP model (and of
        FSDP's ``clip_grad_norm_``): call it on every rank after the last backward and before
        ``step()``. It averages the gradients over the ranks (the reduce-scatter ``step()``
        would do; ``step()`` then does not do it again), computes the norm of the whole averaged
        gradient — each rank's share of ``Σ|g|^p`` over its slice, all-reduced — and multiplies
        this rank's slice by ``min(1, max_norm / (norm + 1e-6))``, torch's formula. The norm equals
        DDP's within a rounding (DDP sums per-parameter norms in another order), so the clipped
        training matches DDP + ``torch.nn.utils.clip_grad_norm_`` within a rounding per step, and
        bit for bit on 2 ranks when no step is clipped. Afterwards only this rank's slice
        (``opt.shard.grad``) holds averaged gradients: in stage 1 the model's ``.grad`` hold
        partial sums of the reduce-scatter, in stage 2 they are ``None``.

        ``torch.nn.utils.clip_grad_norm_(model.parameters(), …)`` does not work here — before
        ``step()`` each rank holds its own un-averaged gradients (stage 1), or none (stage 2: it
        would return 0.0) — so it raises on a ZeroOptimizer's parameters, naming this method; and
        in stage 1 ``step()`` still refuses gradients scaled since backward by factors that differ
        between the ranks (a reference to torch's function taken before the optimizer existed).

        Example::

            >>> import torch, gpucourse as gc
            >>> def clipped(rank, world_size):
            ...     torch.manual_seed(0)
            ...     model = torch.nn.Linear(4, 3)
            ...     opt = gc.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
            ...     model(torch.randn(4, 4)[rank::2]).square().sum().backward()
            ...     norm = opt.clip_grad_norm_(1.0)                # the same on every rank
            ...     after = opt.clip_grad_norm_(1.0)               # already clipped: norm 1
            ...     opt.step(); opt.zero_grad()
            ...     return round(norm.item(), 4), round(after.item(), 4)
            >>> (n0, a0), (n1, a1) = gc.launch(clipped, 2)
            >>> n0 == n1 and n0 > 1.0, a0, a1
            (True, 1.0, 1.0)
        """
        max_norm, norm_type = float(max_norm), float(norm_type)
        self._average_now()
        grad = self.shard.grad
        if grad is None:
            grad = torch.zeros_like(self.shard)
        if norm_type == float("inf"):
            total = grad.abs().max() if grad.numel() else grad.new_zeros(())
            if self.world_size > 1:
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.group)
        else:
            total = torch.linalg.vector_norm(grad, norm_type).pow(norm_type)
            if self.world_size > 1:
                dist.all_reduce(total, group=self.group)
            total = total.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grad.mul_(coef)
        return total

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the averaged gradients to ``[-clip_value, clip_value]``, as DDP + torch's does.

        ``torch.nn.utils.clip_grad_value_`` on a DDP model clamps the *averaged* gradients, element
        by element. Here it averages them first (as :meth:`clip_grad_norm_` does) and clamps this
        rank's slice: the same elements, the same result, bit for bit. Call it on every rank
        after the last backward and before ``step()``.
        """
        clip_value = float(clip_value)
        if not clip_value >= 0:
            raise ValueError(f"clip_value must be a number >= 0, got {clip_value!r}")
        self._average_now()
        if self.shard.grad is not None:
            self.shard.grad.clamp_(-clip_value, clip_value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the model's gradients and the shard's gradient, as ``torch.optim`` does.

        ``set_to_none=False`` in stage 1 zeroes the flat gradient buffer and keeps the ``.grad``
        views into it, so the next backward accumulates straight into it (no copy, as DDP's
        ``gradient_as_bucket_view``); with ``True`` the ``.grad`` are ``None`` until the next
        backward, which ``step()`` then copies into the buffer.
        """
        self.shard.grad = None
        self._stepped = self._averaged = self._reduced = False
        for piece, _ in self._pieces:
            if piece is not None:
                piece.grad = None
        if set_to_none:                           # torch: .grad None (False: zeros, still a gradient)
            self._got_grad.clear()
        self._written.clear()
        if not set_to_none and self._grads is not None:
            self._grads.zero_()
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None and (self._grads is None or p.grad.untyped_storage().data_ptr()
                                         != self._grads.untyped_storage().data_ptr()):
                p.grad.zero_()

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (layers unfrozen for fine-tuning, say); its state starts fresh, as in ``torch.optim``.

        After construction this is a collective — call it on every rank with the same parameters:
        the flat buffer grows and every rank's slice moves, so the state is gathered and cut again.
        """
        books.check_group(param_group, len(self.param_groups), self._seen)
        if not self._built:                       # from torch.optim's constructor
            super().add_param_group(param_group)
            return
        self._check_not_retired()
        full = books.gather_full_state(self, to=None)
        super().add_param_group(param_group)
        self._build()
        books.load_full_state(self, full, groups=len(self.param_groups) - 1)

    def _check_trainable_unchanged(self) -> None:
        now = [p.requires_grad for g in self.param_groups for p in g["params"]]
        if now != self._trainable:
            changed = [i for i, (a, b) in enumerate(zip(now, self._trainable)) if a != b]
            raise RuntimeError(f"parameters {changed} (indices over param_groups) changed requires_grad "
                               "since the ZeroOptimizer was built; its flat buffer holds the trainable "
                               "parameters of that moment. Build the optimizer on the parameters you train "
                               "and add newly unfrozen ones with add_param_group() (their state starts "
                               "fresh, as in torch.optim), or build a new ZeroOptimizer.")

    # -- checkpoints: the whole state gathered on one rank, or this rank's slice -------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state on rank ``to``, as ``ZeroRedundancyOptimizer.consolidate_state_dict``.

        A collective: every rank calls it. Until the next ``step()``, :meth:`state_dict` on rank
        ``to`` then returns the state of every parameter in ``torch.optim``'s format — loadable by
        a ``ZeroOptimizer`` on any number of ranks, or by the plain optimizer on the whole model
        (on the other ranks it raises, as ``ZeroRedundancyOptimizer``'s).
        """
        validate.check_int("to", to, 0, maximum=self.world_size - 1)
        self._consolidated = books.gather_full_state(self, to)

    def state_dict(self) -> dict:
        """The whole state in ``torch.optim``'s format, on the rank that :meth:`consolidate_state_dict`
        sent it to, as ``ZeroRedundancyOptimizer.state_dict``; raises anywhere else.

        Loadable by a ``ZeroOptimizer`` on any number of ranks, or by the plain optimizer on the
        whole model. Without consolidating first (on every rank) there is no whole state to return
        — each rank holds only its slice — so this raises at once instead of saving a slice that
        fails only when loaded; :meth:`shard_state_dict` returns the slice, on purpose.
        """
        if self._consolidated is None:
            raise RuntimeError(
                f"ZeroOptimizer.state_dict() on rank {self.rank}: the optimizer state is sharded and has not "
                "been consolidated on this rank since the last step(). Call opt.consolidate_state_dict(to=0) on "
                "every rank first, then opt.state_dict() on rank 0 (as torch's ZeroRedundancyOptimizer); or "
                "save each rank's own slice with opt.shard_state_dict() and reload it on the same rank of the "
                "same number of ranks.")
        return self._consolidated

    def shard_state_dict(self) -> dict:
        """This rank's slice of the state (no communication), marked with its rank and layout.

        Save one per rank and reload each with :meth:`load_state_dict` on the same rank of the
        same number of ranks; for a checkpoint that loads anywhere, consolidate instead.
        """
        return books.shard_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (from :meth:`consolidate_state_dict`, or a plain optimizer's on the same
        parameter groups) and keep this rank's slice, or reload this rank's own slice (from
        :meth:`shard_state_dict`)."""
        validate.check_type("state_dict", state_dict, dict)
        if books.SHARD_KEY in state_dict:
            books.load_shard_state(self, state_dict)
        else:
            books.load_full_state(self, state_dict)
        books.sync_options(self.param_groups, self.optimizer.param_groups)
        self.state = self.optimizer.state
        self._consolidated = None


# --- torch's clipping functions on a ZeroOptimizer's parameters: refused, naming the right call ----

_LIVE: "weakref.WeakSet[ZeroOptimizer]" = weakref.WeakSet()


def _weakly(opt: "ZeroOptimizer", method):
    """``method`` of ``opt`` as a callback that does not keep ``opt`` alive (nothing once it is gone)."""
    ref = weakref.ref(opt)

    def call(*args):
        target = ref()
        if target is not None:
            method(target, *args)
    return call


def _remove_all(hooks: dict) -> None:
    """Remove the hooks in ``hooks`` (``id(param) → handle``) and forget them."""
    for handle in hooks.values():
        handle.remove()
    hooks.clear()


def _owner(parameters) -> "ZeroOptimizer | None":
    ids = {id(p) for p in parameters}
    return next((opt for opt in list(_LIVE) if any(id(p) in ids for p in opt.params)), None)


def _refusal(function: str, opt: "ZeroOptimizer", right: str) -> RuntimeError:
    held = ("its own un-averaged gradients" if opt.stage == 1
            else "none (they live in the optimizer's shard: the parameters' .grad are None)")
    return RuntimeError(
        f"torch.nn.utils.{function} on the parameters of gc.ZeroOptimizer(stage={opt.stage}): before "
        f"step() each rank holds {held}, so it would not clip what DDP + torch's {function} clips "
        f"(the averaged gradients) and would train differently without saying so. Call {right} "
        "on every rank instead, after backward and before step().")


_NORM, _VALUE = "opt.clip_grad_norm_(max_norm)", "opt.clip_grad_value_(clip_value)"
_clipping_guarded = False


def _guard_torch_clipping() -> None:
    """Make PyTorch's gradient clipping refuse a ZeroOptimizer's parameters, naming the right call.

    Neither ``clip_grad_norm_`` nor ``clip_grad_value_`` can work on them, and neither fails by
    itself: before ``step()`` a rank holds its own un-averaged gradients (stage 1) — clamping them
    is not clamping the average — or none at all (stage 2: the norm comes out 0.0 and nothing is
    clipped). Installed once, when the first ZeroOptimizer is built; on any other parameters
    PyTorch's own functions run unchanged.

    A script may have imported the functions before that (``from torch.nn.utils import
    clip_grad_norm_`` at its top), so rebinding the names is not enough. Each of PyTorch's
    functions is a small ``_no_grad`` wrapper that calls the real function through its closure:
    the guard goes into that closure, so every reference to ``clip_grad_norm_``,
    ``clip_grad_value_`` and ``clip_grads_with_norm_``, old or new, checks its parameters. On a
    torch whose functions are not built that way, the public names are rebound instead (a
    reference taken earlier then escapes the check).
    """
    global _clipping_guarded
    if _clipping_guarded:                 # every ZeroOptimizer calls this; the wrapping happens once
        return
    _clipping_guarded = True
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    def guard(original, function, right):
        @functools.wraps(original)
        def guarded(parameters, *args, **kwargs):
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            opt = _owner(parameters)
            if opt is not None:
                raise _refusal(function, opt, right)
            return original(parameters, *args, **kwargs)
        guarded._gpucourse_guarded = True
        return guarded

    for function, right, where in (("clip_grad_norm_", _NORM, "clip_grad_norm_"),
                                   ("clip_grad_value_", _VALUE, "clip_grad_value_"),
                                   ("clip_grads_with_norm_", _NORM, "_clip_grads_with_norm_")):
        public = getattr(clip_grad, where, None)
        if public is None:
            continue
        code, closure = getattr(public, "__code__", None), getattr(public, "__closure__", None) or ()
        names = code.co_freevars if code is not None else ()
        cell = closure[names.index("func")] if "func" in names else None
        if cell is not None and inspect.isfunction(cell.cell_contents):
            if not getattr(cell.cell_contents, "_gpucourse_guarded", False):
                cell.cell_contents = guard(cell.cell_contents, function, right)
            continue
        guarded = guard(public, function, right)           # no closure to reach: rebind the names
        for module in (utils, clip_grad):
            if getattr(module, function, None) is public:
                setattr(module, function, guarded)
        if where != function and getattr(clip_grad, where, None) is public:
            setattr(clip_grad, where, guarded)


_scaler_guarded = False


def _support_grad_scaler() -> None:
    """Teach ``torch.amp.GradScaler`` a ZeroOptimizer's gradients (installed once).

    The scaler unscales and checks ``optimizer.param_groups``' ``.grad``: before ``step()`` those
    are each rank's own un-averaged gradients (stage 1) or none (stage 2), so the ranks would
    disagree on skipping a step (one rank waited in ``step()`` until the timeout) or record no
    check at all. For a ZeroOptimizer its ``_unscale_grads_`` instead averages the gradients into
    the shard (as ``opt.clip_grad_norm_`` does; ``step()`` does not again), unscales this rank's
    slice, checks it for inf / nan, and all-reduces the finding (MAX): the same decision and the
    same next scale on every rank, as DDP's all-reduced gradients give. Averaging then
    unscaling by a power of two is what DDP + GradScaler computes, bit for bit. Every other
    optimizer goes through PyTorch's method unchanged.
    """
    global _scaler_guarded
    if _scaler_guarded:
        return
    _scaler_guarded = True
    from torch.amp.grad_scaler import GradScaler

    original = GradScaler._unscale_grads_

    @functools.wraps(original)
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        if not isinstance(optimizer, ZeroOptimizer):
            return original(self, optimizer, inv_scale, found_inf, allow_fp16)
        optimizer._average_now()
        grad = optimizer.shard.grad
        device = optimizer.flat.device
        found = torch.zeros((), dtype=torch.float32, device=device)
        if grad is not None:
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            torch._amp_foreach_non_finite_check_and_unscale_([grad], found, inv_scale.to(device))
        if optimizer.world_size > 1:             # any rank's slice: skip everywhere
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=optimizer.group)
        return {device: found}

    GradScaler._unscale_grads_ = _unscale_grads_


def _per_element(value, piece) -> bool:
    """Is this state tensor one value per element of ``piece`` (Adam's moments, SGD's momentum)?"""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == piece.numel()


def _broadcast_in_place(p: torch.Tensor, src: int, group) -> None:
    with torch.no_grad():
        buf = p.detach().contiguous()             # gloo sends memory as it lies: contiguous first
        dist.broadcast(buf, src, group=group)
        if buf.data_ptr() != p.data_ptr():
            p.copy_(buf)
