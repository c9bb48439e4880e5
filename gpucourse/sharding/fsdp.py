"""ZeRO-3 (fully sharded data parallelism) from scratch: each rank stores 1/N of every parameter.

ZeRO-1/2 still keep every parameter on every rank. ZeRO-3 — PyTorch's FSDP, DeepSpeed stage 3 —
keeps only a shard and rebuilds each layer's full parameters just for the moment they are used:

1) **shard** — each layer's own parameters are flattened into one padded buffer; rank ``r`` keeps
   slice ``r`` as an ``nn.Parameter`` (so ``parameters()`` yields shards, and any optimizer built
   on them updates shards). The layer's own parameters are removed.
2) **forward** — a forward pre-hook all-gathers the layer's full buffer and points the layer's
   ``weight``/``bias`` at views into it; a forward hook drops them again after the layer ran.
3) **backward** — autograd wants the full weights again (a Linear needs ``W`` for ``dL/dx``).
   Instead of keeping them, :class:`FullyShardedModule` saves a *note* in their place
   (``torch.autograd.graph.saved_tensors_hooks``) and all-gathers them again when the backward
   unpacks the note.
4) **gradients** — the all-gather is an autograd function whose backward is a **reduce-scatter**:
   the full gradient of the layer's buffer is summed over ranks and rank ``r`` keeps slice ``r``,
   divided by N (the average DDP computes), as the gradient of its shard. The full parameters are
   dropped.

Communication per step: all-gather (forward) + all-gather (backward) + reduce-scatter = 1.5× the
all-reduce of DDP. Memory: the shards (1/N) plus one layer's full parameters at a time.

**Tied weights.** A weight read *outside* its layer's forward — GPT's head ``x @ tok_emb.weightᵀ``
after the embedding ran — is already freed when it is needed. Such layers stay gathered for the
whole forward of the model (FSDP's *root unit*): every ``nn.Embedding`` by default, or the layers
named in ``keep_gathered``. Both uses add their gradient into the one gathered buffer, so its
reduce-scatter sends the tied weight's full gradient once. A parameter that two modules *hold*
(nanoGPT's ``head.weight = wte.weight``) is sharded once, in the first module's unit, which stays
gathered for the whole forward; the other module's attribute points at the same gathered view.

**In your own loop** (frozen layers, bf16 compute) — the plumbing is small: a frozen parameter
gets a unit of its own that is gathered but never reduce-scattered; ``param_dtype`` casts each
shard before the all-gather and each gradient back to fp32 before the reduce-scatter, as FSDP2's
``MixedPrecisionPolicy(param_dtype=…, reduce_dtype=torch.float32)`` does.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import math
import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import EndOfBackward, graph_nodes, group_info, output_tensors, same_on_every_rank, validate
from .collectives import _all_gather_flat, _reduce_scatter_flat, shard_size

__all__ = ["FullyShardedModule"]

#: set on every parameter a :class:`FullyShardedModule` took out of its layer (its new home is a shard)
_SHARDED_AWAY = "_gpucourse_sharded_away"
_hook_installed = False


def _refuse_optimizer_of_the_unwrapped_model(optimizer, args, kwargs) -> None:
    """A global optimizer step pre-hook: an optimizer built from the model's parameters *before*
    :class:`FullyShardedModule` wrapped it holds tensors no layer uses any more — their ``.grad``
    stays None and ``step()`` trains nothing, silently. Refuse, saying the fix."""
    _refuse_groups_picked_by_name(optimizer)
    names = [getattr(p, _SHARDED_AWAY) for group in optimizer.param_groups for p in group["params"]
             if getattr(p, _SHARDED_AWAY, None) is not None]
    if names:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise RuntimeError(
            f"{type(optimizer).__name__} holds parameters that gc.FullyShardedModule took out of the model "
            f"({shown}): it was built before the model was wrapped, so it would train nothing. Build the "
            f"optimizer after wrapping, from the wrapped model: sharded = gc.FullyShardedModule(model); "
            f"opt = torch.optim.AdamW(sharded.parameters(), ...)")


def _refuse_groups_picked_by_name(optimizer) -> None:
    """An empty parameter group beside one holding shards: the groups were picked by parameter name
    (``"bias" in name``), by shape (``len(p.shape) >= 2``) or by another test no shard passes, and
    matched nothing — ``named_parameters()``
    of a :class:`FullyShardedModule` names its flat shards ``shards.0``, ``shards.1``, … — so the
    other group's settings (its weight decay) would silently apply to every parameter."""
    groups = optimizer.param_groups
    _refuse_a_split_no_shard_can_follow(optimizer)
    holding = [i for i, g in enumerate(groups) if any(isinstance(p, _FlatShard) for p in g["params"])]
    empty = [i for i, g in enumerate(groups) if not g["params"]]
    if holding and empty:
        i, j = empty[0], holding[0]
        settings = {k: v for k, v in groups[j].items() if k != "params" and v != groups[i].get(k)}
        shown = ", ".join(f"{k}={v}" for k, v in list(settings.items())[:3]) or "its settings"
        raise RuntimeError(
            f"{type(optimizer).__name__}: parameter group {i} is empty, while group {j} holds gc.FullyShardedModule's "
            f"shards — groups picked by parameter name (\"bias\" in name) or by shape (len(p.shape) >= 2) "
            f"match nothing here, because named_parameters() names the flat shards shards.0, shards.1, … and "
            f"each is one 1-D tensor holding a whole unit's parameters, so group {j}'s {shown} would apply "
            f"to every parameter. Put all of "
            "model.parameters() in one group, or choose groups per unit (model.shards[i]); FSDP2's "
            "fully_shard keeps each parameter's name and shape and can split them.")


def _refuse_a_split_no_shard_can_follow(optimizer) -> None:
    """Groups that treat plain vectors and matrices differently (no weight decay on biases and
    norms), beside a shard holding both: the split was made per parameter — by a name test on
    names an enclosing module built (``blocks.0.shards.0`` for a FullyShardedModule per block), or
    by hand — and this shard's vectors get its group's decay, or its matrices miss it, unlike
    FSDP2's. Refused: a shard's parameters can share only one group."""
    groups = optimizer.param_groups

    def decay(g):
        return g.get("weight_decay", 0.0) or 0.0

    seen = tuple((len(g["params"]), decay(g)) for g in groups)     # checked once per grouping
    if getattr(optimizer, "_gpucourse_split_checked", None) == seen:
        return

    plain = [collections.Counter("vectors" if p.dim() < 2 else "matrices" for p in g["params"]
                                 if not isinstance(p, _FlatShard)) for g in groups]   # per group, once
    for j, g in enumerate(groups):
        for shard in (p for p in g["params"] if isinstance(p, _FlatShard) and len(getattr(p, "_kinds", ())) > 1):
            for kind in ("vectors", "matrices"):
                other = next((i for i, h in enumerate(groups) if decay(h) != decay(g) and plain[i][kind]), None)
                if other is None:
                    continue
                raise RuntimeError(
                    f"{type(optimizer).__name__}: group {j} (weight_decay={decay(g)}) holds gc.FullyShardedModule's "
                    f"shard of {shard._holds}, while group {other} (weight_decay={decay(groups[other])}) holds "
                    f"{plain[other][kind]} {kind} outside the shards: the groups split parameters one "
                    f"by one (by name or by shape), but a shard is one flat tensor of its whole unit, so its {kind} "
                    f"would get weight_decay={decay(g)} — unlike FSDP2, which shards each parameter. Names an "
                    "enclosing module builds (blocks.0.shards.0) do not name the parameters in a shard. Wrap the "
                    "whole model in one gc.FullyShardedModule (its named_parameters() refuse such tests), or put "
                    "every parameter in one group.")
    optimizer._gpucourse_split_checked = seen


def _install_hook() -> None:
    global _hook_installed
    if not _hook_installed:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_refuse_optimizer_of_the_unwrapped_model)
        _hook_installed = True


class _Unit:
    """One unit's parameters (``params``: ``[(name relative to module, parameter), …]``, all
    trainable or all frozen): names, shapes, where they sit in its flat buffer, its shard, and the
    dtype they are gathered in for compute."""

    def __init__(self, path: str, module: nn.Module, params: list, group, rank: int, world_size: int,
                 root_rank: int, param_dtype: torch.dtype | None = None, aliases: dict | None = None):
        self.path, self.module, self.group = path, module, group
        self.rank, self.world_size = rank, world_size
        self.trainable = params[0][1].requires_grad
        self.names = [n for n, _ in params]
        # per parameter: every (module holding it, attribute) — more than one for a tied weight
        aliases = aliases or {}
        self.owners = [[_owner(module, n)] + [(m, leaf) for m, leaf, _ in aliases.get(id(p), [])]
                       for n, p in params]
        self.alias_names = {n: [name for _, _, name in aliases.get(id(p), [])] for n, p in params}
        self.shapes = [p.shape for _, p in params]
        self.numels = [p.numel() for _, p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.padded = world_size * shard_size(sum(self.numels), world_size)
        first = params[0][1]
        flat = torch.zeros(self.padded, dtype=first.dtype, device=first.device)   # (N·S,)
        with torch.no_grad():
            for (_, p), off in zip(params, self.offsets):
                flat[off:off + p.numel()] = p.reshape(-1)
        if world_size > 1:
            dist.broadcast(flat, root_rank, group=group)       # every rank starts from rank 0's values
        self.shard = _FlatShard(flat.view(world_size, -1)[rank].clone(), requires_grad=self.trainable)  # (S,)
        shown = ", ".join(self.names[:4]) + (" …" if len(self.names) > 4 else "")
        self.shard._holds = f"unit {path!r} ({shown})"          # for _FlatShard's messages
        self.shard._kinds = {"vectors" if len(s) < 2 else "matrices" for s in self.shapes}
        self.compute_dtype = param_dtype or self.shard.dtype      # the shard stays the master copy
        self.full = None                    # the gathered (N·S,) buffer while it is needed
        self.sync, self.pending = True, None    # gradient sync off: the unsharded gradient so far
        self.pending_used = None                # ... and which parameters got a gradient in it
        # at the end of a synchronised backward: flush every unit of the module (FullyShardedModule
        # gives its units one, shared)
        self.flush = EndOfBackward(functools.partial(_flush_pending, [self]))
        # the full names of the parameters in the shard, for the step check's messages
        self.shard._names = [f"{path}.{n}" if path else n for n in self.names]
        self.shard._used_here = None            # set by a synchronised backward: a flag per parameter
        for owner, leaf in (o for owners in self.owners for o in owners):
            del owner._parameters[leaf]     # the layer keeps no parameters of its own any more
            setattr(owner, leaf, None)
        for n, p in params:                 # marked (not kept: no reference to the full tensors)
            setattr(p, _SHARDED_AWAY, f"{path}.{n}" if path else n)

    def gather(self, *, keep: bool = True) -> torch.Tensor:
        """All-gather the full flat buffer in the compute dtype (no autograd): ``(N·S,)``.

        The shard is cast *before* the all-gather (bf16 sends half the bytes of fp32), as FSDP2
        does. ``keep=False``: do not hold on to the result (a frozen unit's backward re-gather,
        which no reduce-scatter frees afterwards).
        """
        if self.full is not None:
            return self.full
        full = self.all_gather(self.compute_dtype)
        if keep:
            self.full = full
        return full

    def all_gather(self, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(self.padded, dtype=dtype, device=self.shard.device)
        buf.view(self.world_size, -1)[self.rank].copy_(self.shard.detach())      # cast here
        return _all_gather_flat(buf, self.group)

    def views(self, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The unit's parameters as views into the flat buffer ``full``, in ``names`` order."""
        return tuple(full[off:off + n].view(shape) for shape, off, n in zip(self.shapes, self.offsets, self.numels))

    def attach(self, params) -> None:
        """Point the layer's parameter names at ``params`` (views into the gathered buffer)."""
        for owners, p in zip(self.owners, params):
            for owner, leaf in owners:
                setattr(owner, leaf, p)

    def release(self) -> None:
        self.full = None
        for owner, leaf in (o for owners in self.owners for o in owners):
            setattr(owner, leaf, None)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _from_user_code(depth: int) -> bool:
    """Is the frame ``depth`` levels up outside torch and gpucourse (a script, a notebook cell)?"""
    name = sys._getframe(depth + 1).f_code.co_filename
    return not (name.startswith(_TORCH_DIR) or name.startswith(_OWN_DIR))


def _grouping_message(what: str, holds: str) -> str:
    return (f"{what} of a gc.FullyShardedModule parameter: each one is a flat 1-D shard of a whole unit's "
            f"parameters — this one holds {holds} — so it cannot tell a weight matrix from a bias, and "
            "parameter groups built from it (weight decay on p.dim() >= 2 or len(p.shape) >= 2, none on "
            "names with 'bias' in them) would silently decay nothing, or everything. "
            "Parameter groups can separate units, not the parameters inside one: put all of "
            "model.parameters() in one group (weight decay on every parameter), or choose groups per unit "
            "(model.shards[i]) yourself; FSDP2's fully_shard keeps each parameter's shape and name and can "
            "split them.")


class _ShardShape(tuple):
    """What ``p.shape`` / ``p.size()`` of a shard gives user code: ``torch.Size``'s values, printed
    as one, but ``len()`` raises (``torch.Size`` cannot be subclassed). A ``TypeError``, so that
    ``list(p.shape)`` and ``[*p.shape]`` — which ask ``len()`` only for a hint — still work."""

    def __len__(self):
        raise TypeError(_grouping_message("len(p.shape) (or len(p.size()))", self._holds))

    def numel(self) -> int:
        return math.prod(self)

    def __repr__(self):
        return f"torch.Size({list(self)!r})"

    def __reduce__(self):                     # saved as the torch.Size it stands for
        return torch.Size, (tuple(self),)


def _shard_shape(size, holds: str) -> _ShardShape:
    shape = _ShardShape(size)
    shape._holds = holds
    return shape


def _shard_name(name: str, holds: str) -> "_ShardName":
    name = _ShardName(name)
    name._holds = holds
    return name


class _ShardName(str):
    """A name that runs through gc.FullyShardedModule's shards (``shards.0``, ``blocks.0.shards.3``).

    Such a name names a unit, not a parameter, so a test for ``"bias"`` in it, asked from user
    code, refuses instead of matching nothing (a no-decay group that comes out empty and is
    dropped, or that holds only other modules' biases, would leave the shards' biases decayed).
    The module registers its ``shards`` under such a name, and ``+`` keeps the type, so the names
    an enclosing module's ``named_parameters()`` builds (``prefix + "." + key``) are ones too.
    PyTorch's own code (``torch.distributed.checkpoint`` splits names) gets plain ``str``
    behaviour."""

    _holds = "a whole unit's parameters"

    def _refuse(self, what, method, *args, **kwargs):
        if not _from_user_code(2):
            return method(str(self), *args, **kwargs)
        raise TypeError(_grouping_message(f"{what} on the name {str(self)!r}", self._holds))

    def __contains__(self, part):
        return self._refuse(f"{part!r} in name", str.__contains__, part)

    def endswith(self, *args):
        return self._refuse(f"name.endswith{args!r}".replace(",)", ")"), str.endswith, *args)

    def startswith(self, *args):
        return self._refuse(f"name.startswith{args!r}".replace(",)", ")"), str.startswith, *args)

    def split(self, *args, **kwargs):
        return self._refuse("name.split(...)", str.split, *args, **kwargs)

    def rsplit(self, *args, **kwargs):
        return self._refuse("name.rsplit(...)", str.rsplit, *args, **kwargs)

    def lower(self):
        return _shard_name(str.lower(self), self._holds)

    def __add__(self, other):
        return _shard_name(str.__add__(self, other), self._holds) if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return _shard_name(str.__add__(other, self), self._holds) if isinstance(other, str) else NotImplemented

    def __reduce__(self):                     # saved (an optimizer's param_names) as a plain str
        return str, (str(self),)


class _FlatShard(nn.Parameter):
    """A unit's shard: one flat 1-D slice of *all* the unit's parameters (a Linear's weight and bias).

    The usual weight-decay groupings — ``p.dim() >= 2``, ``len(p.shape) >= 2``, ``"bias" in name``
    — would put every shard in one group and silently train without weight decay, or with it on
    the biases (FSDP2 keeps each parameter's shape and name). So, asked from user code, a shard's
    ``dim()`` (``ndim``, ``ndimension()``) raises, ``len()`` of its ``shape`` / ``size()`` raises,
    and its name from ``named_parameters()`` refuses substring tests. Everything else — optimizers,
    ``numel()``, ``shape[0]``, printing the shape — works as on a 1-D parameter.
    """

    _holds = "a unit"

    def _refuse(self, what: str):
        frame, callers = sys._getframe(2), []
        while frame is not None and len(callers) < 40:
            callers.append(frame.f_code.co_filename.replace("\\", "/"))
            frame = frame.f_back
        if any("torch/_dynamo" in c or "torch/_inductor" in c for c in callers):
            _refuse_compile(always=True)
        caller = callers[0]
        if "torch/distributed/checkpoint" in caller:     # set_model_state_dict / set_state_dict
            raise RuntimeError(
                "torch.distributed.checkpoint's set_model_state_dict / set_state_dict cannot load into "
                "gc.FullyShardedModule (its parameters are flat shards, not FSDP2's DTensors): load the "
                "unsharded model's state dict on every rank with model.load_state_dict(full) — "
                "get_model_state_dict(model) and model.state_dict() give it")
        raise RuntimeError(_grouping_message(what, self._holds))

    def dim(self):
        self._refuse("p.dim()")

    def ndimension(self):
        self._refuse("p.ndimension()")

    @property
    def ndim(self):
        self._refuse("p.ndim")

    @property
    def shape(self):
        shape = super().shape
        if not _from_user_code(1):
            return shape
        return _shard_shape(shape, self._holds)

    def size(self, dim=None):
        if dim is not None:
            return super().size(dim)
        size = super().size()
        return _shard_shape(size, self._holds) if _from_user_code(1) else size

    def __repr__(self):
        return f"FullyShardedModule shard of {self._holds}:\n{self.detach()!r}"


def _note_written(shard) -> None:
    """After backward accumulated into a shard's gradient: its version and norm, for the check below."""
    if shard.grad is None:                  # set_requires_gradient_sync(False): nothing accumulated
        return
    shard._written = (shard.grad._version, torch.linalg.vector_norm(shard.grad.detach()))


def _check_shards_at_step(optimizer, args, kwargs) -> None:
    """A global optimizer step pre-hook, for an optimizer that holds shards; it refuses the step

    * on shards whose gradients were scaled, since backward, by different factors on different
      ranks — ``torch.nn.utils.clip_grad_norm_`` on the shards clips each rank by the norm of its
      own shards, and the ranks' models drift apart. A factor the ranks share —
      :meth:`FullyShardedModule.clip_grad_norm_`, a constant, no clipping at all — passes, and so
      does a change that is not one factor for all of a rank's shards;
    * on a shard some of whose parameters got no gradient on any rank while others did: the
      optimizer steps the shard as one tensor, so weight decay, momentum and Adam's moments would
      move the unused ones, which DDP(find_unused_parameters=True) and FSDP2 leave untouched.

    One small all-reduce per step (every rank steps the optimizer): both checks share it.
    """
    shards = [p for g in optimizer.param_groups for p in g["params"]
              if isinstance(p, _FlatShard) and getattr(p, "_group", False) is not False]
    if not shards:
        return
    _check_element_wise_once(optimizer, shards[0])
    ratios = []
    for p in shards:
        written = getattr(p, "_written", None)
        if p.grad is None or written is None:
            continue
        version, before = written
        if p.grad._version == version:
            ratios.append(1.0)
        else:
            before = before.item()
            if 0 < before < float("inf"):
                ratios.append(torch.linalg.vector_norm(p.grad.detach()).item() / before)
    ratios = [r for r in ratios if r == r and r < float("inf")]
    # torch's clip multiplies all of a rank's gradients by one factor; anything else is not a clip
    factor = max(ratios) if ratios and max(ratios) - min(ratios) <= 1e-5 * max(ratios) else 1.0
    used = []                               # per parameter of every shard: got a gradient here
    for p in shards:
        here = getattr(p, "_used_here", None)
        if p.grad is None or here is None:  # no backward since the last step (or no record of one)
            here = [False] * len(p._names)
        used += [float(u) for u in here]
        p._used_here = None
    group = shards[0]._group
    flags = torch.tensor([factor, -factor, *used], dtype=torch.float64, device=shards[0].device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)    # used anywhere: 1
    everywhere = flags[2:].tolist()
    unused, at = [], 0
    for p in shards:
        mine, at = everywhere[at: at + len(p._names)], at + len(p._names)
        if any(mine) and not all(mine):
            unused.append((p._holds, [n for n, u in zip(p._names, mine) if not u]))
    if unused:
        names = [n for _, ns in unused for n in ns]
        layers = sorted({n.rpartition(".")[0] for n in names} - {""})
        units = f" (units=[..., {', '.join(map(repr, layers))}])" if layers else ""
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): parameter(s) {names} got no gradient on any rank since the "
            f"last step, but share a flat shard with parameters that did ({'; '.join(h for h, _ in unused)}). "
            "The optimizer steps a shard as one tensor, so weight decay, momentum or Adam's moments would "
            "move them, where DDP(find_unused_parameters=True) and FSDP2 leave them untouched. Give their "
            f"layer a unit of its own{units}: a unit that no rank used gets no gradient, and the optimizer "
            "skips it; or freeze them (requires_grad_(False)), or use them.")
    hi, lo = flags[0].item(), -flags[1].item()
    if hi - lo > 1e-5 * max(abs(hi), abs(lo)):
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): the gradients of gc.FullyShardedModule's shards were scaled "
            f"since backward by factors from {lo:.6g} to {hi:.6g} on the ranks; each rank holds only its "
            "shards, so torch.nn.utils.clip_grad_norm_(model.parameters(), …) clips each rank by the norm "
            "of its own shards and the ranks would train differently from DDP and from each other. Clip with "
            "model.clip_grad_norm_(max_norm) instead: the global norm, as FSDP1's "
            "FullyShardedDataParallel.clip_grad_norm_.")


#: optimizers of shards whose rule was found element-wise (:func:`_check_element_wise_once`)
_element_wise: "weakref.WeakSet" = weakref.WeakSet()


def _check_element_wise_once(optimizer, like: torch.Tensor) -> None:
    """At an optimizer's first step on shards: refuse a rule that does not update each element on its
    own (``ValueError``), as :class:`~gpucourse.ZeroOptimizer` does at construction — a shard is a 1-D
    slice across a unit's parameters, so Adafactor (factored moments of a matrix) trained 5e-3 away
    from DDP + Adafactor in 3 steps, and LBFGS (dot products over one rank's shard) 0.8, without an
    error. Each group's options (those the class takes, ``optimizer.defaults``) are probed once. An
    optimizer whose class cannot be built again from its own options (not a ``torch.optim`` one) is
    not probed."""
    if optimizer in _element_wise:
        return
    from .zero_bookkeeping import check_element_wise

    cls, probed = type(optimizer), set()
    for g in optimizer.param_groups:
        options = {k: v for k, v in g.items() if k in optimizer.defaults}
        key = repr(sorted(options.items()))
        if key in probed:
            continue
        probed.add(key)
        try:
            cls([nn.Parameter(torch.zeros(1))], **options)
        except (TypeError, ValueError):
            continue
        check_element_wise(cls, options, like, who="gc.FullyShardedModule")
    _element_wise.add(optimizer)


_clip_check_installed = False


def _install_clip_check() -> None:
    global _clip_check_installed
    if not _clip_check_installed:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_check_shards_at_step)
        _clip_check_installed = True


def _torch_arguments(module, param_dtype, mp_policy, reshard_after_forward, reduce_dtype):
    """PyTorch's FSDP arguments with their meaning where the course's class does the same; a message
    saying what it does instead where not. Returns ``param_dtype``."""
    if reshard_after_forward is not True and reshard_after_forward is not False:
        raise ValueError(
            f"reshard_after_forward={reshard_after_forward!r} is not supported: gc.FullyShardedModule takes "
            "True (free a unit's parameters after its forward, gather them again for its backward: FSDP2's "
            "default) or False (keep them from the forward to the backward); FSDP2's int (reshard to a "
            "smaller group) has no counterpart here")
    dtypes = {p.dtype for p in module.parameters()}
    if mp_policy is not None:
        if param_dtype is not None:
            raise ValueError("pass param_dtype= or mp_policy=, not both")
        fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
        if not all(hasattr(mp_policy, f) for f in fields):
            raise TypeError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {mp_policy!r}")
        if mp_policy.output_dtype is not None or not mp_policy.cast_forward_inputs:
            raise ValueError(
                "mp_policy: output_dtype and cast_forward_inputs=False are not supported: gc.FullyShardedModule "
                "casts the floating-point inputs to param_dtype and returns the outputs as computed; cast the "
                "output yourself (out.float())")
        reduce = mp_policy.reduce_dtype
        if mp_policy.param_dtype is not None and reduce is None:
            raise ValueError(
                f"mp_policy=MixedPrecisionPolicy(param_dtype={mp_policy.param_dtype}, reduce_dtype=None): FSDP2 "
                f"then reduces the gradients in {mp_policy.param_dtype}; gc.FullyShardedModule always casts them "
                "to the parameters' dtype before the reduce-scatter — pass reduce_dtype=torch.float32 (the "
                "parameters' dtype), which it does the same as FSDP2")
        param_dtype = mp_policy.param_dtype
        reduce_dtype = reduce
    if reduce_dtype is not None and dtypes != {reduce_dtype}:
        raise ValueError(
            f"reduce_dtype={reduce_dtype} is not supported: gc.FullyShardedModule reduce-scatters the gradients "
            f"in the parameters' own dtype ({', '.join(sorted(str(d) for d in dtypes))}); leave it out, or "
            "pass that dtype")
    return param_dtype


def _refuse_compile(always: bool = False) -> None:
    if always or torch.compiler.is_compiling():
        raise RuntimeError(
            "torch.compile does not support gc.FullyShardedModule: its hooks gather and free parameters "
            "in Python (a table of gathered buffers, set in forward and read in backward), which the "
            "compiler cannot trace. Run it eagerly, or compile the unwrapped model's blocks (FSDP2's "
            "fully_shard supports torch.compile).")


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """``("attn.q.weight")`` → ``(module.attn.q, "weight")``."""
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    return module, leaf


class _GatherParams(torch.autograd.Function):
    """Forward: all-gather a unit's shards, return its parameters (views into the buffer).
    Backward: copy their gradients into one flat buffer, reduce-scatter it, averaged.

    One output per parameter, not the flat buffer: autograd would turn each view's gradient into a
    zero-filled gradient of the *whole* buffer and add them up — a block of 16 parameters would
    fill and add 16 buffers of its full size."""

    @staticmethod
    def forward(ctx, shard, unit):
        ctx.unit = unit
        ctx.set_materialize_grads(False)      # an unused parameter's gradient arrives as None
        return unit.views(unit.gather())

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        unit.full = None                                      # backward of this layer is done
        # (N·S,) in the shard's dtype: low-precision gradients are cast up *before* the sum
        flat = torch.empty(unit.padded, dtype=unit.shard.dtype, device=unit.shard.device)
        flat[sum(unit.numels):].zero_()                       # the padding
        for g, off, n in zip(grads, unit.offsets, unit.numels):
            if g is None:                                     # a parameter this step did not use
                flat[off:off + n].zero_()
            else:
                flat[off:off + n].copy_(g.reshape(-1))
        used = [g is not None for g in grads]
        if unit.pending is not None:                          # micro-batches under no_sync(): DDP's
            flat = unit.pending.add_(flat)                    # local sum, in the same order
            used = [a or b for a, b in zip(used, unit.pending_used)]
            unit.pending = unit.pending_used = None
        if not unit.sync:                                     # set_requires_gradient_sync(False)
            unit.pending, unit.pending_used = flat, used      # the full gradient, kept locally
            return None, None
        unit.flush.arm()                    # a unit used only in no_sync() micro-batches: at the end
        return _reduce_into_shard(unit, flat, used), None


def _reduce_into_shard(unit, flat: torch.Tensor, used: list[bool]) -> torch.Tensor:
    """Reduce-scatter a unit's full gradient ``flat``: this rank's slice of the average."""
    unit.shard._used_here = used                              # checked at the optimizer's step
    if unit.world_size > 1:         # an inf/nan on this rank reaches every rank's slice (GradScaler)
        _spread_non_finite(flat, unit.world_size)
    mine = _reduce_scatter_flat(flat, unit.group)             # (S,) sum over ranks of my slice
    return mine.div(unit.world_size)                          # ... divided by N once


def _flush_pending(units) -> None:
    """End of a synchronised backward: a unit whose gradient was accumulated under ``no_sync()`` but
    that this backward did not reach still sends its sum, as DDP does for a parameter used in the
    micro-batches before the last (before, the sum was kept and never sent, and the shard not stepped).
    Every rank flushes the same units, in the same order: the ones the earlier micro-batches used."""
    for unit in units:
        if unit.pending is None or not unit.sync:
            continue
        flat, used = unit.pending, unit.pending_used
        unit.pending = unit.pending_used = None
        mine = _reduce_into_shard(unit, flat, used)
        if unit.shard.grad is None:
            unit.shard.grad = mine
        else:
            unit.shard.grad.add_(mine)
        _note_written(unit.shard)                            # as autograd's hook would


def _spread_non_finite(flat: torch.Tensor, world_size: int) -> None:
    """If ``flat`` holds an inf or nan, write nan into the first element of every rank's slice.

    The reduce-scatter hands each rank only its slice of the sum: an overflow in one element would
    reach one rank, whose ``torch.amp.GradScaler`` skips the step while the others take it (and
    wait in the next collective). DDP's all-reduce puts the inf on every rank. With the nan in
    every slice, every rank's scaler finds it and skips the same step, as with DDP. No
    synchronisation with the device: a ``torch.where``, not an ``if``."""
    bad = ~torch.isfinite(flat).all()
    heads = flat.view(world_size, -1)[:, 0]
    heads.copy_(torch.where(bad, torch.full_like(heads, float("nan")), heads))


class _Note:
    """Saved for backward instead of a gathered weight: which unit, and which view of its buffer."""

    __slots__ = ("offset", "size", "stride", "unit")

    def __init__(self, unit, t):
        self.unit, self.size, self.stride, self.offset = unit, t.size(), t.stride(), t.storage_offset()


#: modules whose forward reads their children's parameters directly: below no listed unit, they form
#: one unit with those children (``nn.MultiheadAttention`` and its ``out_proj``), as FSDP2 would need
_READS_CHILDREN = (nn.MultiheadAttention,)


def _units_of(module: nn.Module, units) -> tuple[list[tuple[str, nn.Module, list]], dict]:
    """``[(path, module, [(name relative to it, parameter), …]), …]``: one unit per path in ``units``
    (the parameters below it that no deeper path claims), then every module that owns parameters
    below no path, on its own (``units=None``: all of them) — except the children of a module in
    ``_READS_CHILDREN``, which join its unit. A parameter that several modules own
    (a tied weight, ``head.weight = wte.weight``) is claimed by the first; the second dict maps it
    to its other owners, ``id(param) → [(module, attribute, full name), …]``."""
    modules = dict(module.named_modules())
    if units is None:
        units = []
    elif isinstance(units, str):
        raise TypeError(f"units must be a list of module paths, got one string {units!r}; write [{units!r}]")
    else:
        units = list(units)
        bad = [u for u in units if not isinstance(u, str)]
        if bad:
            raise TypeError(f"units must be module paths (str), got {bad!r}")
        if len(set(units)) != len(units):
            raise ValueError(f"units: {sorted(u for u in set(units) if units.count(u) > 1)} listed more than once")
        unknown = [u for u in units if u not in modules]
        if unknown:
            raise ValueError(f"units: {unknown} are not modules of {type(module).__name__}; "
                             f"its modules: {list(modules)[:8]}{' …' if len(modules) > 8 else ''}")

    def unit_of(path: str):                     # the deepest listed path at or above ``path``
        above = [u for u in units if u == "" or path == u or path.startswith(u + ".")]
        return max(above, key=len) if above else None

    # modules whose forward reads their children's parameters without calling the children: a child
    # in a unit of its own would not be gathered then (MultiheadAttention passes out_proj.weight to
    # F.multi_head_attention_forward; it failed with "linear(): argument 'weight' … not NoneType")
    readers = [path for path, m in modules.items() if isinstance(m, _READS_CHILDREN)]
    claimed, loose, aliases, seen = {u: [] for u in units}, [], {}, set()
    loose_at: dict[str, list] = {}              # path of a loose unit -> its parameters
    for path, m in modules.items():
        own = []
        for n, p in m._parameters.items():
            if p is None:
                continue
            if id(p) in seen:                   # tied: already claimed by an earlier module
                aliases.setdefault(id(p), []).append((m, n, f"{path}.{n}" if path else n))
            else:
                seen.add(id(p))
                own.append((n, p))
        if not own:
            continue
        u = unit_of(path)
        if u is None:
            reader = next((r for r in readers if path.startswith(r + ".") and r in loose_at), None)
            if reader is not None:              # with the reader's own parameters, in its unit
                rel = path[len(reader) + 1:]
                loose_at[reader] += [(f"{rel}.{n}", p) for n, p in own]
            else:
                loose.append((path, m, own))
                loose_at[path] = own
            continue
        rel = path[len(u):].lstrip(".")
        claimed[u] += [(f"{rel}.{n}" if rel else n, p) for n, p in own]
    empty = [u for u in units if not claimed[u]]
    if empty:
        raise ValueError(f"units: {empty} hold no parameters (none below them, or deeper units claim them all)")
    return [(u, modules[u], claimed[u]) for u in units] + loose, aliases


def _tied_outside(owners: list, aliases: dict) -> dict[str, list[str]]:
    """Units holding a tied weight that a module *outside* the unit also holds: ``{path: [names]}``.

    The unit's own forward hooks do not cover that other module's forward, so the unit must stay
    gathered for the whole forward (a GPT head tied to the embedding, ``head.weight = wte.weight``).
    """
    out = {}
    for path, _, params in owners:
        for n, p in params:
            for _, _, name in aliases.get(id(p), []):
                holder = name.rpartition(".")[0]
                if path and holder != path and not holder.startswith(path + "."):
                    out.setdefault(path, []).append(name)
    return out


class FullyShardedModule(nn.Module):
    """ZeRO-3 from scratch: every layer's parameters sharded over the ranks, gathered when used.

    Every submodule that owns parameters (a ``Linear``, a ``LayerNorm``, …) becomes a *unit* — or,
    with ``units=``, every listed module (a transformer block) with all its parameters: its
    parameters are flattened, padded to split evenly, and rank ``r`` keeps slice ``r``. Forward and
    backward gather a unit's full parameters just before it runs and free them after; the backward
    reduce-scatters the gradients into the shards — summed over ranks, then divided by N once.
    Outputs equal the unsharded model's, and an optimizer on ``parameters()`` makes the same
    updates as DDP + that optimizer on the same global batch: bit for bit on 2 ranks, within one
    rounding of the gradient per step on 3 (DDP multiplies by ``1/N`` before it sums; see
    ``zero.py``'s module docstring for the measurement and for why neither equals one process on
    the whole batch bit for bit). A layer *called twice* in one forward is gathered, and
    reduce-scattered, once per call: ``(a₁ + b₁)/2 + (a₂ + b₂)/2`` where DDP sums locally first,
    ``((a₁ + a₂) + (b₁ + b₂))/2`` — equal within a rounding; list it in ``keep_gathered`` for DDP's
    bits (one gather, one reduce-scatter of the summed gradient).

    **Frozen parameters** (``requires_grad=False``, a frozen embedding) are sharded and gathered
    like the others, in units of their own, but never reduce-scattered: their shards have
    ``requires_grad=False`` and get no gradient, so an optimizer on ``parameters()`` leaves them.

    **Unused parameters.** A unit that no rank used gets no gradient, and the optimizer skips it, as
    DDP(find_unused_parameters=True) and FSDP2 skip an unused parameter. A parameter that no rank
    used *beside* parameters of its unit that were used is refused at ``optimizer.step()``: the
    optimizer steps the unit's shard as one tensor, and weight decay or momentum would move it. A
    parameter that some ranks use and others do not is refused after the forward, on every rank
    (the ranks' backward collectives would differ; FSDP2 does not support it either): one small
    all-reduce after every forward that can be back-propagated checks it, where there is more than
    one rank. (A layer with a unit of its own that some ranks skip makes the forward's all-gather
    wait; ``gc.launch``'s timeout names the rank and the line.) A unit used only in ``no_sync()``
    micro-batches sends its accumulated gradient at the end of the next synchronised backward.

    **Mixed precision** (``param_dtype=torch.bfloat16`` or ``torch.float16``): the shards stay in the
    model's dtype (fp32) — they are the master weights the optimizer updates. Each all-gather casts
    the shard to ``param_dtype`` first (half the bytes on the wire), the layers compute in it, and
    floating-point inputs of the model and of every unit are cast to it; each unit's gradients are
    cast back to fp32 *before* the reduce-scatter, so the shards' gradients are summed and stored in
    fp32 — FSDP2's ``MixedPrecisionPolicy(param_dtype=…, reduce_dtype=torch.float32)``.

    Args:
        module: the model. Its parameters are taken out of it (rank 0's values are used on every
            rank, as DDP does); buffers (BatchNorm's statistics) stay as they are.
        group: the process group (default: the default group).
        keep_gathered: paths (as in ``named_modules()``) of the units whose parameters stay
            gathered from the start to the end of the model's forward instead of only during their
            own forward; needed for a weight the model reads outside its layer, e.g. a head tied to
            the embedding. ``None`` (default): every unit that holds an ``nn.Embedding``, and every
            unit holding a weight that a module outside it holds too (``head.weight = wte.weight``:
            one parameter, sharded once, under both names) — an explicit list must include those.
        units: paths of modules to shard as *one* unit each — FSDP's wrapping, e.g. every
            transformer block and ``""`` (the model: whatever no block claims). A unit holds every
            parameter below it that no deeper unit in the list claims; modules owning parameters
            below no listed path stay units of their own. ``None`` (default): one unit per module
            that owns parameters. Each unit costs up to 3 blocking collectives per forward +
            backward (all-gather, all-gather again for the backward — skipped when the backward
            does not read the weights, as an embedding's — and reduce-scatter): fewer, larger units
            mean fewer waits, while more full parameters exist at once (a whole block's).
        param_dtype: ``None`` (default: compute in the parameters' own dtype) or the dtype the
            layers compute in, e.g. ``torch.bfloat16``; the shards and their gradients keep the
            parameters' dtype.
        mp_policy: FSDP2's ``MixedPrecisionPolicy(param_dtype=…, reduce_dtype=torch.float32)`` — the
            same as ``param_dtype=…``; a policy the class cannot follow (reduce in bf16,
            ``output_dtype``) is refused with a message.
        reshard_after_forward: ``True`` (FSDP2's default): a unit's full parameters are freed
            after its forward and all-gathered again for its backward. ``False``: they stay from
            the forward to the backward — one all-gather per unit and step instead of two, more
            memory between the passes — as FSDP2's ``False``; the arithmetic is the same.
        reduce_dtype: ``None`` or the parameters' own dtype (the gradients are reduce-scattered in
            it); any other is refused.

    Gradient accumulation without communication: :meth:`set_requires_gradient_sync` (FSDP2) or
    :meth:`no_sync` (DDP, FSDP1). The model's own attributes and methods are reachable on the
    wrapper (``model.loss(x, y)``, as FSDP2 keeps the model's class); ``state_dict()`` and
    ``load_state_dict()`` take the *unsharded* model's keys (FSDP's full state dict) on every rank;
    :meth:`shard_state_dict` is this rank's flat shards. ``torch.compile`` is refused with a message.

    Example::

        >>> import torch, gpucourse as gc
        >>> def demo(rank, world_size):
        ...     torch.manual_seed(0)
        ...     model = gc.FullyShardedModule(torch.nn.Linear(4, 3))   # 15 parameters
        ...     out = model(torch.ones(2, 4))
        ...     return [p.numel() for p in model.parameters()], tuple(out.shape)
        >>> gc.launch(demo, 2)                                     # 8 + 8 (one of padding)
        [([8], (2, 3)), ([8], (2, 3))]
        >>> def wrapped(rank, world_size):                          # 2 layers: 2 units, or 1
        ...     net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
        ...     each = gc.FullyShardedModule(net)
        ...     net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
        ...     return len(each.shards), len(gc.FullyShardedModule(net, units=[""]).shards)
        >>> gc.launch(wrapped, 2)[0]
        (2, 1)
        >>> def bf16(rank, world_size):                             # bf16 compute, fp32 master shards
        ...     model = gc.FullyShardedModule(torch.nn.Linear(4, 3), param_dtype=torch.bfloat16)
        ...     out = model(torch.ones(2, 4))
        ...     out.float().sum().backward()
        ...     shard = model.shards[0]
        ...     return out.dtype, shard.dtype, shard.grad.dtype
        >>> gc.launch(bf16, 2)[0]
        (torch.bfloat16, torch.float32, torch.float32)

    .. warning::
        Every rank must run the same layers in the same order, forward and backward: each gather
        and reduce-scatter is a collective. A rank that skips a layer (``if rank == 0:``) leaves
        the others waiting until the timeout. The largest layer's full parameters must fit on one
        device — sharding does not split a layer's computation (that is tensor parallelism).
        A layer's parameters exist only while it runs: code that reads ``layer.weight`` outside
        the layer's forward (a tied head ``F.linear(x, self.tok_emb.weight)``) finds ``None``
        unless the layer is in ``keep_gathered`` (embeddings are, by default), or shares a unit
        with the reader (``torch.nn.MultiheadAttention`` reads its ``out_proj.weight`` so: its
        children join its unit by default). With
        ``param_dtype`` the outputs come in that dtype: compute the loss in fp32
        (``loss_fn(out.float(), y)``). fp16 gradients can underflow without loss scaling;
        ``torch.amp.GradScaler`` works as with DDP: an inf or nan in a unit's gradient on any rank
        puts a nan into every rank's shard of that unit's gradient (DDP's all-reduce puts it at
        its own position on every rank), so every rank's scaler skips the same step. To clip gradients call
        :meth:`clip_grad_norm_` (the global norm), not ``torch.nn.utils.clip_grad_norm_`` on
        ``parameters()``, which sees this rank's shards only. The optimizer sees one flat shard
        per unit, so parameter groups can separate units but not the parameters inside one
        (no weight decay on a Linear's bias alone); FSDP2 shards each parameter and can. So that
        the usual groupings do not silently decay nothing (or every bias), they refuse: a shard's
        ``dim()`` and ``ndim`` raise, so does ``len()`` of its ``shape`` (which still prints and
        indexes as ``(S,)``), and the names ``named_parameters()`` gives (``shards.0``,
        ``shards.1``, …; ``blocks.0.shards.0`` from an enclosing module) refuse ``"bias" in n``
        and ``n.endswith(…)``. Names a script rebuilds as plain strings (an f-string) escape
        that: ``step()`` then refuses an empty group beside the shards, or groups that treat
        plain vectors and matrices differently beside a shard holding both (an empty group
        dropped before the optimizer is built, with no such plain parameters, is not caught).
    """

    def __init__(self, module: nn.Module, group=None, *, keep_gathered=None, units=None, param_dtype=None,
                 mp_policy=None, reshard_after_forward=True, reduce_dtype=None):
        super().__init__()
        validate.check_type("module", module, nn.Module, "an nn.Module")
        if not any(True for _ in module.parameters()):
            raise ValueError(f"module ({type(module).__name__}) has no parameters: there is nothing to shard")
        param_dtype = _torch_arguments(module, param_dtype, mp_policy, reshard_after_forward, reduce_dtype)
        if param_dtype is not None and not (isinstance(param_dtype, torch.dtype) and param_dtype.is_floating_point):
            raise TypeError(f"param_dtype must be None or a floating-point torch.dtype such as torch.bfloat16, "
                            f"got {param_dtype!r}")
        mixed = [path for path, m in module.named_modules()
                 if len({p.dtype for p in m.parameters(recurse=False)}) > 1]
        if mixed:
            raise ValueError(f"modules {mixed} own parameters of different dtypes; each layer's parameters "
                             "are flattened into one buffer and must share one dtype")
        # 1) one unit per submodule that owns parameters itself (Linear, LayerNorm, ...), or per
        #    module named in ``units`` (all the parameters below it that no deeper unit claims)
        owners, aliases = _units_of(module, units)
        tied = _tied_outside(owners, aliases)   # unit path -> a weight another module reads too
        if keep_gathered is None:              # embeddings (the layer a GPT head is tied to), ties
            keep_gathered = [path for path, m, params in owners
                             if any(isinstance(_owner(m, n)[0], nn.Embedding) for n, _ in params)
                             or path in tied]
        else:
            if isinstance(keep_gathered, str):
                raise TypeError("keep_gathered must be a list of module paths, got one string "
                                f"{keep_gathered!r}; write [{keep_gathered!r}]")
            keep_gathered = list(keep_gathered)
            unknown = sorted(set(keep_gathered) - {path for path, _, _ in owners})
            if unknown:
                raise ValueError(f"keep_gathered: {unknown} are not units (modules that own parameters, or "
                                 f"the paths in units=); allowed: {[path for path, _, _ in owners]}")
            missing = {path: names for path, names in tied.items() if path not in keep_gathered}
            if missing:
                raise ValueError(f"keep_gathered must list the units of tied weights (one tensor that several "
                                 f"modules hold), which are read outside their unit's forward: {missing}; "
                                 f"add {sorted(missing)}")
        rank, world_size, global_rank = group_info(group)
        same_on_every_rank("the parameters' names, shapes and requires_grad and the units",
                            ([(n, tuple(p.shape), p.requires_grad) for n, p in module.named_parameters()],
                             [path for path, _, _ in owners]), group)
        self.module, self.group = module, group
        self.rank, self.world_size, self.param_dtype = rank, world_size, param_dtype
        self.reshard_after_forward = reshard_after_forward
        self._param_names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
        self._state_keys = list(module.state_dict(keep_vars=True))   # the plain model's keys, in order
        # frozen parameters get units of their own: gathered alike, never reduce-scattered
        self._units = [_Unit(path, m, part, group, rank, world_size, global_rank(0), param_dtype, aliases)
                       for path, m, params in owners
                       for part in ([(n, p) for n, p in params if p.requires_grad],
                                    [(n, p) for n, p in params if not p.requires_grad]) if part]
        self.shards = nn.ParameterList([u.shard for u in self._units])   # what parameters() yields
        flush = EndOfBackward(functools.partial(_flush_pending, self._units))   # one per module
        for unit in self._units:
            unit.flush = flush
        # registered under a _ShardName: every name built through it refuses "bias" in name
        self._modules = {(_ShardName(k) if k == "shards" else k): m for k, m in self._modules.items()}
        _install_hook()     # an optimizer built before this wrap holds the parameters taken out: refused
        self._gathered: dict[int, _Unit] = {}       # storage pointer of a gathered buffer -> its unit
        # the units gathered for the whole forward (FSDP's root unit), the others around their layer
        self._outer = [u for u in self._units if u.path in set(keep_gathered)]
        self._depth, self._saved_hooks = 0, None    # the root context: see _enter / _exit
        # the root context around the wrapped module's own forward — model(x), and model.module(x)
        # or a method of the model that calls it (TinyGPT.loss calls self(idx)); it runs first
        self._root_calls = 0
        module.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True, prepend=True)
        for unit in self._units:
            if unit in self._outer:               # gathered by the root, or lazily inside a method
                for holder in {id(m): m for owners in unit.owners for m, _ in owners}.values():
                    holder.register_forward_pre_hook(self._make_lazy_hook(unit))
                continue
            unit.module.register_forward_pre_hook(self._make_pre_hook(unit), with_kwargs=True)
            unit.module.register_forward_hook(self._make_post_hook(unit), always_call=True)
        module.register_forward_hook(self._root_post_hook, always_call=True)     # after the units'
        for unit in self._units:                  # what backward wrote, to catch a per-rank clip
            if unit.trainable:
                unit.shard._group = group
                unit.shard.register_post_accumulate_grad_hook(_note_written)
        _install_clip_check()

    # -- 2) forward: gather before the layer, free after it -------------------------------------
    def _gather(self, unit) -> None:
        if unit.full is not None:                 # kept from a forward whose backward has not run
            unit.full = None                      # (reshard_after_forward=False): gather afresh
        if unit.trainable and torch.is_grad_enabled():
            params = _GatherParams.apply(unit.shard, unit)      # backward = reduce-scatter
        else:
            params = unit.views(unit.gather())
        self._gathered[unit.full.untyped_storage().data_ptr()] = unit
        unit.attach(params)

    def _release(self, unit, *, keep: bool = False) -> None:
        """Free the unit's full parameters; ``keep``: only take them off the layer, for the backward
        to use and free (``reshard_after_forward=False``)."""
        if unit.full is not None:
            self._gathered.pop(unit.full.untyped_storage().data_ptr(), None)
        full = unit.full
        unit.release()
        if keep:
            unit.full = full

    def _make_pre_hook(self, unit):
        def pre_hook(module, args, kwargs):
            _refuse_compile()
            self._gather(unit)
            if self.param_dtype is not None:                  # FSDP2's cast_forward_inputs
                return _cast_floating(args, self.param_dtype), _cast_floating(kwargs, self.param_dtype)
            return None
        return pre_hook

    def _make_post_hook(self, unit):
        def post_hook(module, args, output):
            # kept only where a backward will free them: _GatherParams.backward drops unit.full
            self._release(unit, keep=not self.reshard_after_forward and unit.trainable
                          and torch.is_grad_enabled())
        return post_hook

    # -- 3) backward: save a note instead of a gathered weight; gather again on unpack ----------
    def _pack(self, t: torch.Tensor):
        unit = self._gathered.get(t.untyped_storage().data_ptr())
        return t if unit is None else _Note(unit, t)

    @staticmethod
    def _unpack(saved):
        if isinstance(saved, _Note):
            unit = saved.unit                     # trainable: freed by _GatherParams.backward;
            full = unit.gather(keep=unit.trainable)   # frozen: nothing frees it, so not kept
            return full.as_strided(saved.size, saved.stride, saved.offset)
        return saved

    # -- the root context: the kept-gathered units and the saved-tensor hooks, around the model ---
    def _enter(self, *, eager: bool = True) -> None:
        """Enter the root context. ``eager``: gather the kept units now (the model's forward, which
        every rank runs); else each when its module is first called (a method such as
        ``num_parameters()`` that one rank may call alone must not start a collective)."""
        _refuse_compile()
        if self._depth == 0:
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            hooks.__enter__()
            self._saved_hooks = hooks
        self._depth += 1
        if eager:
            try:
                for unit in self._outer:          # tied layers: gathered for the whole forward
                    if unit.full is None:
                        self._gather(unit)
            except BaseException:
                self._exit()
                raise

    def _make_lazy_hook(self, unit):
        def lazy_gather(module, args):            # a kept unit first used inside a method
            if self._depth > 0 and unit.full is None:
                self._gather(unit)
        return lazy_gather

    def _exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            for unit in self._outer:
                self._release(unit)
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)

    def _root_pre_hook(self, module, args, kwargs):
        self._enter()
        self._root_calls += 1
        if self.param_dtype is not None:          # FSDP2's cast_forward_inputs (the root's inputs)
            return _cast_floating(args, self.param_dtype), _cast_floating(kwargs, self.param_dtype)
        return None

    def _root_post_hook(self, module, args, output):    # always_call: also when the forward raised
        if self._root_calls:
            self._root_calls -= 1
            self._exit()
            if self.world_size > 1 and torch.is_grad_enabled():
                self._check_same_params_used(output)

    def _check_same_params_used(self, output) -> None:
        """Every rank must use the same parameters: the backward's collectives follow the graph (a
        unit's reduce-scatter, the re-gather of a weight a layer's backward needs), so a branch that
        one rank takes and another does not leaves a rank waiting in a collective the other never
        calls. One small all-reduce after each forward that can be back-propagated refuses it on
        every rank, naming the parameters (FSDP2 does not support it either; DDP does, with
        ``find_unused_parameters=True``, because it all-reduces every bucket whatever was used)."""
        reached: dict[int, set[int]] = collections.defaultdict(set)   # id(unit) -> parameter indices
        trainable = [u for u in self._units if u.trainable]
        differentiable = any(t.grad_fn is not None for t in output_tensors(output))
        if not differentiable or not trainable:
            return
        for node in graph_nodes(output):
            for nxt, index in node.next_functions:      # index: which of the unit's parameters
                if type(nxt).__name__ == "_GatherParamsBackward" and getattr(nxt, "unit", None) is not None:
                    reached[id(nxt.unit)].add(index)
        used = torch.tensor([float(i in reached[id(u)]) for u in trainable for i in range(len(u.names))],
                            dtype=torch.float32, device=trainable[0].shard.device)
        counts = used.clone()
        dist.all_reduce(counts, group=self.group)
        names = [n for u in trainable for n in u.shard._names]
        differ = [n for n, c in zip(names, counts.tolist()) if 0 < c < self.world_size]
        if differ:
            mine = [n for n, u, c in zip(names, used.tolist(), counts.tolist()) if 0 < c < self.world_size and u]
            raise RuntimeError(
                f"FullyShardedModule: parameter(s) {differ} take part in this forward on some ranks only "
                f"(on this rank: {mine or 'none of them'}). The backward's collectives would differ between "
                "the ranks, and they would wait for each other until the timeout. Use every parameter on every "
                "rank (a branch a rank skips can run with its output multiplied by 0), or train with "
                "DDP(find_unused_parameters=True) or gc.MiniDDP(find_unused_parameters=True).")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)       # the root pre-hook gathers the kept units

    def __getattr__(self, name: str):
        """The wrapped model's attributes and methods, as FSDP2 keeps the model's class:
        ``model.loss(x, y)``, ``model.config``. Inside a method each unit is gathered when its
        module is called — the kept-gathered ones (an embedding a tied head reads) then stay
        gathered until the method returns, as in the forward — so a method that calls layers is a
        collective (every rank calls it), one that calls none is not. ``model.module`` is the bare
        model: its forward works (``model.module(x)``), but a method of it that calls a layer
        without calling the model's forward (``model.module.hidden_states(x)``) finds a kept unit's
        parameters ``None``: call it on the wrapper."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
        value = getattr(module, name)
        if inspect.ismethod(value) and value.__self__ is module:
            method = value

            @functools.wraps(method)
            def run_gathered(*args, **kwargs):
                self._enter(eager=False)
                try:
                    return method(*args, **kwargs)
                finally:
                    self._exit()
            return run_gathered
        return value

    # -- gradient accumulation without communication, as FSDP2 / DDP ------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """``nn.Module.named_parameters``: the shards, named ``shards.0``, ``shards.1``, … — each names a
        unit, not a parameter. Given to user code, a shard's name refuses substring tests
        (``"bias" in n``, ``n.endswith("bias")``): they would match no shard, and a no-decay group
        left empty and dropped would decay every bias in silence (the message names the unit's
        parameters; names an enclosing module builds refuse too). ``full_names()`` lists the
        wrapped model's own parameter names."""
        # the names are _ShardNames already (the shards' key is one); here each gets its unit's
        # parameters for the message. They refuse only user code, so torch's callers get them too
        named = super().named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)
        return ((_shard_name(n, p._holds) if isinstance(p, _FlatShard) else n, p) for n, p in named)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch: ``False`` — backward adds each unit's full (unsharded) gradient into a
        local buffer and sends nothing; the next backward with ``True`` adds its gradient to that
        sum and reduce-scatters it once, as DDP's ``no_sync()`` (the same sums in the same order:
        bit for bit like DDP on 2 ranks). Costs one full gradient of the model per rank while off."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}")
        for unit in self._units:
            unit.sync = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's / FSDP1's context manager: :meth:`set_requires_gradient_sync` ``(False)`` inside."""
        before = [u.sync for u in self._units]
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for unit, sync in zip(self._units, before):
                unit.sync = sync

    # -- clipping by the global norm, as FSDP1's FullyShardedDataParallel.clip_grad_norm_ ---------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the shards' gradients by the norm of the *whole* model's gradient; returns that norm.

        ``torch.nn.utils.clip_grad_norm_(model.parameters(), …)`` sees only this rank's shards and
        would clip each rank by its own part of the norm. Call this instead, on every rank, after
        backward and before ``optimizer.step()`` (FSDP1's ``FullyShardedDataParallel.clip_grad_norm_``;
        FSDP2's DTensors make torch's function global): each rank's ``Σ|g|^p`` over its shards
        (the padding is zero) is all-reduced, and every shard's gradient is multiplied by
        ``min(1, max_norm / (norm + 1e-6))``, torch's formula. The norm equals DDP's within a
        rounding (torch sums per-parameter norms, here slices are summed), so training matches DDP
        + ``torch.nn.utils.clip_grad_norm_`` within a rounding per clipped step, and bit for bit
        on 2 ranks when no step is clipped (the factor is then exactly 1).

        Example::

            >>> import torch, gpucourse as gc
            >>> def clipped(rank, world_size):
            ...     torch.manual_seed(0)
            ...     model = gc.FullyShardedModule(torch.nn.Linear(4, 3))
            ...     model(torch.randn(4, 4)[rank::2]).square().sum().backward()
            ...     norm = model.clip_grad_norm_(1.0)               # the same on every rank
            ...     return round(norm.item(), 4), round(model.clip_grad_norm_(1.0).item(), 4)
            >>> (n0, a0), (n1, a1) = gc.launch(clipped, 2)
            >>> n0 == n1 and n0 > 1.0, a0, a1                        # then clipped to norm 1
            (True, 1.0, 1.0)
        """
        max_norm, norm_type = float(max_norm), float(norm_type)
        grads = [u.shard.grad for u in self._units if u.trainable and u.shard.grad is not None]
        device = self._units[0].shard.device
        if norm_type == float("inf"):
            total = (torch.stack([g.abs().max() for g in grads if g.numel()]).max() if grads
                     else torch.zeros((), device=device))
            if self.world_size > 1:
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.group)
        else:
            total = (torch.stack([torch.linalg.vector_norm(g, norm_type).pow(norm_type) for g in grads]).sum()
                     if grads else torch.zeros((), device=device))
            if self.world_size > 1:
                dist.all_reduce(total, group=self.group)
            total = total.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return total

    # -- the whole model, for checks and checkpoints ---------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded model's ``state_dict`` (parameters gathered, buffers as they are), on every rank."""
        out = {}
        for unit in self._units:
            full = unit.all_gather(unit.shard.dtype)          # the master weights, not a cast copy
            prefix = f"{unit.path}." if unit.path else ""
            for name, shape, off, n in zip(unit.names, unit.shapes, unit.offsets, unit.numels):
                out[prefix + name] = full[off:off + n].view(shape).clone()
                for alias in unit.alias_names[name]:            # a tied weight: one tensor, two names
                    out[alias] = out[prefix + name]
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        for name in self._state_keys:                            # the persistent buffers
            if name in buffers and name not in out:
                out[name] = buffers[name].detach().clone()
        return {name: out[name] for name in self._state_keys if name in out} | out   # the model's order

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The *unsharded* model's state dict, on every rank (a collective: call it on all ranks) —
        the keys and shapes of the wrapped model's own ``state_dict()``, loadable into the plain
        model, as FSDP's full state dict (``get_model_state_dict(…, full_state_dict=True)``) and
        DDP's ``model.module.state_dict()``. This rank's flat shards (``shards.N``) are
        :meth:`shard_state_dict`.

        Example::

            >>> import torch, gpucourse as gc
            >>> def saved(rank, world_size):
            ...     torch.manual_seed(0)
            ...     model = gc.FullyShardedModule(torch.nn.Linear(4, 3))
            ...     state = model.state_dict()                       # the plain Linear's keys
            ...     plain = torch.nn.Linear(4, 3)
            ...     plain.load_state_dict(state)                     # loads into the plain model
            ...     fresh = gc.FullyShardedModule(torch.nn.Linear(4, 3))
            ...     fresh.load_state_dict(state)                     # and back into the shards
            ...     x = torch.ones(2, 4)
            ...     return list(state), torch.equal(fresh(x), plain(x)), list(model.shard_state_dict())
            >>> gc.launch(saved, 2)[0]
            (['weight', 'bias'], True, ['shards.0'])
        """
        if args:
            raise TypeError("FullyShardedModule.state_dict() takes keyword arguments only "
                            "(destination=, prefix=, keep_vars=)")
        if keep_vars:
            raise ValueError("FullyShardedModule.state_dict(keep_vars=True): the model's parameters do not "
                             "exist outside the forward (each rank holds flat shards); state_dict() returns "
                             "gathered copies, and shard_state_dict(keep_vars=True) this rank's shards")
        if destination is None:
            destination = {}
        for name, value in self.full_state_dict().items():
            destination[prefix + name] = value
        return destination

    def shard_state_dict(self, *, keep_vars: bool = False) -> dict:
        """This rank's own slices, ``{"shards.N": …}`` and the buffers (``module.…``): what
        ``nn.Module.state_dict`` gives for the wrapper. Reload it on the same rank of the same
        world size with :meth:`load_shard_state_dict`."""
        return nn.Module.state_dict(self, keep_vars=keep_vars)

    def load_shard_state_dict(self, state_dict, strict: bool = True):
        """Load what :meth:`shard_state_dict` saved on this rank."""
        self._loading_shards = True
        try:
            return nn.Module.load_state_dict(self, state_dict, strict=strict)
        finally:
            self._loading_shards = False

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load the *unsharded* model's state dict — the keys of the wrapped model's own
        ``state_dict()``, e.g. saved by :meth:`state_dict`, by DDP's ``model.module.state_dict()``
        or by FSDP's full state dict — on every rank: each rank copies its slice into its shards
        (FSDP's ``set_model_state_dict(…, full_state_dict=True)``). Missing and unexpected keys
        are reported as ``nn.Module.load_state_dict`` reports them."""
        if assign:
            raise ValueError("FullyShardedModule.load_state_dict(assign=True): the parameters are flat shards; "
                             "the values are copied into them (assign=False)")
        keys = set(state_dict)
        if any(k.startswith("shards.") for k in keys) and not any(k in keys for k in self._param_names):
            raise RuntimeError("FullyShardedModule.load_state_dict() takes the unsharded model's state dict "
                               "(its own keys, from state_dict()); this one holds shards (shards.N) — load "
                               "a rank's own shard_state_dict() with load_shard_state_dict()")
        expected = set(self._param_names) | {n for n, _ in self.module.named_buffers()}
        missing = [n for n in self.full_names() if n not in keys]
        unexpected = sorted(keys - expected)
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for FullyShardedModule "
                               f"({type(self.module).__name__}): missing keys {missing}, unexpected keys "
                               f"{unexpected}")
        for unit in self._units:
            prefix = f"{unit.path}." if unit.path else ""
            names = [prefix + n for n in unit.names]
            if not all(n in keys for n in names):
                if any(n in keys for n in names):
                    raise RuntimeError(f"load_state_dict: unit {unit.path!r} is loaded whole; the state dict "
                                       f"has only some of {names}")
                continue
            flat = torch.zeros(unit.padded, dtype=unit.shard.dtype, device=unit.shard.device)
            for name, shape, off, n in zip(names, unit.shapes, unit.offsets, unit.numels):
                value = state_dict[name]
                value = getattr(value, "full_tensor", lambda v=value: v)()     # a DTensor: gathered
                if tuple(value.shape) != tuple(shape):
                    raise RuntimeError(f"load_state_dict: {name} has shape {tuple(value.shape)}, the model's "
                                       f"is {tuple(shape)}")
                flat[off:off + n] = value.reshape(-1)
            unit.shard.copy_(flat.view(self.world_size, -1)[self.rank])
        for name, buf in self.module.named_buffers():
            if name in keys:
                buf.copy_(state_dict[name])
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def full_names(self) -> list[str]:
        """The keys of the wrapped model's own state dict (parameters, tied ones under each name, and
        persistent buffers)."""
        return list(self._state_keys)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.__dict__.get("_loading_shards"):
            return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        raise RuntimeError("a gc.FullyShardedModule inside another module cannot be loaded by the outer "
                           "module's load_state_dict(); call load_state_dict() on the FullyShardedModule "
                           "itself with the inner model's keys")


def _cast_floating(obj, dtype: torch.dtype):
    """``obj`` (a tensor, or tuples, lists and dicts of them) with floating-point tensors cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):                 # a namedtuple
        return type(obj)(*(_cast_floating(o, dtype) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast_floating(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floating(v, dtype) for k, v in obj.items()}
    return obj
