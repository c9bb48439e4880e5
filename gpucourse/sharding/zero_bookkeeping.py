"""ZeroOptimizer's bookkeeping: parameter groups on one flat buffer, and its checkpoints.

None of this is ZeRO's algorithm (``zero.py`` is); it is what lets :class:`ZeroOptimizer` stand in
for a ``torch.optim`` optimizer in a learner's own loop:

- **parameter groups** — :func:`param_groups_of` checks what the constructor (or
  ``add_param_group``) receives; :class:`FlatLayout` lays the *trainable* parameters out group after
  group in the flat buffer, so rank ``r``'s shard holds one contiguous **piece** of each group
  (possibly empty), and the inner optimizer gets one parameter group per piece, with that group's
  options; :func:`sync_options` copies ``lr``, ``weight_decay``, … between the outer groups (what a
  scheduler changes) and the inner ones (what the inner optimizer reads).
- **checkpoints** — :func:`shard_state_dict` is this rank's slice (no communication);
  :func:`gather_full_state` rebuilds ``torch.optim``'s format for the whole model (one tensor per
  parameter, indices over every parameter of every group, frozen ones included) on one rank or on
  all; :func:`load_full_state` cuts such a state back into this rank's pieces, for any number of
  ranks; :func:`load_shard_state` reloads one rank's own slice.

Per-element state (Adam's ``exp_avg``, SGD's ``momentum_buffer``) is sliced with the parameters;
scalar state (Adam's ``step``) is one value per piece, the same on every rank that holds a piece of
the group. Optimizers that are not element-wise (Adafactor's factored moments and RMS-scaled steps,
trust ratios) cannot be sharded this way: :func:`check_element_wise` refuses them at construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import validate
from .collectives import shard_size

__all__: list[str] = []

SHARD_KEY = "zero_shard"          # marks a state_dict that holds one rank's slice only


# --- parameter groups -----------------------------------------------------------------------------

def param_groups_of(params) -> list[dict]:
    """``params`` as ``torch.optim`` takes it (tensors, or dicts of ``"params"`` + options) → group dicts.

    Checks every tensor and that no parameter is listed twice, with messages that name the place.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors (model.parameters()) or of parameter "
                        "groups (dicts), got one tensor")
    try:
        items = list(params)
    except TypeError:
        raise TypeError(f"params must be an iterable of tensors or of parameter groups (dicts), "
                        f"got {type(params).__name__}") from None
    if not items:
        raise ValueError("params is empty: the model has no parameters to optimize")
    dicts = [isinstance(item, dict) for item in items]
    if any(dicts) and not all(dicts):
        raise TypeError("params mixes tensors and parameter groups (dicts); pass either "
                        "model.parameters() or a list of {'params': ..., option: value} dicts")
    groups = [dict(item) for item in items] if all(dicts) else [{"params": items}]
    seen: dict[int, int] = {}
    for g, group in enumerate(groups):
        check_group(group, g, seen, single=not all(dicts))
    return groups


def check_group(group: dict, index: int, seen: dict[int, int], *, single: bool = False) -> None:
    """One parameter group: a dict with ``"params"`` (tensors, or ``(name, tensor)`` pairs), none of
    them already in a group (``seen``: ``id(param)`` → its group index, updated)."""
    where = "params" if single else f"param_groups[{index}]"
    validate.check_type(where, group, dict, "a dict with a 'params' key")
    if "params" not in group:
        raise ValueError(f"{where} has no 'params' key; write {{'params': [...], 'lr': ...}}")
    params = group["params"]
    if isinstance(params, set):
        raise TypeError(f"{where}['params'] is a set, whose order changes between runs; pass a list")
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    group["params"] = params
    mine: set[int] = set()
    for i, p in enumerate(params):
        name = f"{where}[{i}]" if single else f"{where}['params'][{i}]"
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):    # named_parameters()
            name, p = f"{name} ({p[0]!r})", p[1]
        validate.check_tensor(name, p, floating=True)
        if id(p) in mine:
            raise ValueError(f"{name} appears twice in {where}; list each parameter once")
        if id(p) in seen:
            raise ValueError(f"{name} is also in param_groups[{seen[id(p)]}]; a parameter may belong to "
                             "one parameter group only")
        mine.add(id(p))
    seen.update(dict.fromkeys(mine, index))


def check_trainable(param_groups: list[dict]) -> list[torch.Tensor]:
    """The trainable parameters (what goes into the flat buffer): at least one, one dtype and device."""
    trainable = [p for g in param_groups for p in g["params"] if p.requires_grad]
    if not trainable:
        raise ValueError("none of the parameters requires grad: there is nothing to optimize")
    kinds = {(str(p.dtype), str(p.device)) for p in trainable}
    if len(kinds) > 1:
        raise ValueError(f"the trainable parameters must share one dtype and device (one flat buffer), "
                         f"got {sorted(kinds)}")
    return trainable


@dataclass
class FlatLayout:
    """Where every trainable parameter sits in the flat buffer: group after group, in order.

    ``group_ranges[g]`` is ``[lo, hi)`` of group ``g``'s trainable elements; rank ``r`` owns
    ``ranges[r]`` (padded, equal sizes) and so ``piece(g, r)`` of group ``g`` — their intersection.
    """

    params: list[torch.Tensor]              # trainable parameters, group after group
    offsets: list[int]
    group_ranges: list[tuple[int, int]]
    numel: int
    ranges: list[tuple[int, int]]           # every rank's shard [start, end), padded

    @classmethod
    def of(cls, param_groups: list[dict], world_size: int) -> FlatLayout:
        params, offsets, group_ranges, offset = [], [], [], 0
        for group in param_groups:
            lo = offset
            for p in group["params"]:
                if p.requires_grad:
                    params.append(p)
                    offsets.append(offset)
                    offset += p.numel()
            group_ranges.append((lo, offset))
        s = shard_size(offset, world_size)
        return cls(params, offsets, group_ranges, offset, [(r * s, (r + 1) * s) for r in range(world_size)])

    def piece(self, group: int, rank: int) -> tuple[int, int]:
        """``[lo, hi)`` of group ``group``'s elements that rank ``rank`` owns (``lo == hi``: none)."""
        (glo, ghi), (start, end) = self.group_ranges[group], self.ranges[rank]
        lo, hi = max(glo, start), min(ghi, end)
        return (lo, hi) if lo < hi else (lo, lo)

    def signature(self, param_groups: list[dict]) -> list[list[tuple]]:
        """What must match for a shard's state to load: every group's parameter shapes and flags."""
        return [[(tuple(p.shape), p.requires_grad) for p in g["params"]] for g in param_groups]


def sync_options(src: list[dict], dst: list[dict]) -> None:
    """Copy every option but the parameters (``lr``, ``weight_decay``, a scheduler's ``initial_lr``)."""
    for s, d in zip(src, dst):
        for key, value in s.items():
            if key not in ("params", "param_names"):
                d[key] = value


def options(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


#: what to use instead, per class that shards parameters into 1-D slices (the refusal names it)
INSTEAD = {"ZeroOptimizer": "torch's ZeroRedundancyOptimizer (whole parameters per rank) or DDP",
           "gc.FullyShardedModule": "DDP (torch's fully_shard refuses it too)"}


def check_element_wise(optimizer_class, kwargs: dict, like: torch.Tensor, who: str = "ZeroOptimizer") -> None:
    """Refuse an optimizer that does not update each element on its own (raise ``ValueError``).

    Each rank's inner optimizer steps 1-D slices of the flat buffer, which cut across parameters.
    That equals stepping whole parameters only for an element-wise rule (SGD, Adam, AdamW, …).
    Adafactor (factored moments of a matrix, steps scaled by the parameter's RMS), LAMB-like
    trust ratios, Muon (matrices only) and LBFGS (a closure) are not: Adafactor on slices trained
    4e-3 to 7e-3 away from DDP + Adafactor in 5 steps, without an error. So every ZeroOptimizer
    (and every optimizer of :class:`~gpucourse.FullyShardedModule`'s shards, ``who``, at its first
    step) first steps two small matrices twice, whole and as two 1-D slices across both, with the
    user's options, and compares the updates (no randomness drawn from torch's generator). The
    probe runs in float32 where the parameters are bf16 or fp16: the rule is what is asked about,
    and a bf16 kernel can round an element differently in a vector's body and in its tail, so the
    slices of SGD + momentum in bf16 moved 0.002 away from the whole matrices (of updates up to
    0.43) and an element-wise rule was refused.
    """
    name = getattr(optimizer_class, "__name__", repr(optimizer_class))
    gen = torch.Generator().manual_seed(0)
    shapes = [(6, 5), (4, 5)]
    dtype = torch.float32 if like.dtype in (torch.bfloat16, torch.float16) else like.dtype

    def draw():
        return [torch.randn(s, generator=gen).to(like.device, dtype) for s in shapes]

    start, grads = draw(), [draw(), draw()]
    whole = [nn.Parameter(t.clone()) for t in start]
    opt = optimizer_class(whole, **kwargs)          # the user's options: their errors, unchanged
    flat_start = torch.cat([t.reshape(-1) for t in start])
    pieces = [nn.Parameter(s.clone()) for s in flat_start.tensor_split([17])]   # across both matrices
    try:
        for g in grads:
            for p, t in zip(whole, g):
                p.grad = t.clone()
            opt.step()
        sliced = optimizer_class([{"params": [p]} for p in pieces], **kwargs)
        for g in grads:
            for p, t in zip(pieces, torch.cat([t.reshape(-1) for t in g]).tensor_split([17])):
                p.grad = t.clone()
            sliced.step()
    except Exception as error:
        raise ValueError(
            f"{who} cannot shard {name}: stepping 1-D slices of parameters (what each rank's "
            f"shard is), with no closure, failed with {type(error).__name__}: {error}. {who} "
            "needs an optimizer that updates each element on its own (SGD, Adam, AdamW, …); for "
            f"{name}, use {INSTEAD.get(who, 'DDP')}") from error
    moved = torch.cat([p.detach().reshape(-1) for p in whole]) - flat_start
    apart = (torch.cat([p.detach() for p in pieces]) - flat_start - moved).abs().max().item()
    if apart > 1e-3 * moved.abs().max().item():
        raise ValueError(
            f"{who} cannot shard {name}: it does not update each element on its own (two "
            f"steps of a 6x5 and a 4x5 matrix, whole and cut into two 1-D slices across both, moved "
            f"them {apart:.2g} apart, of updates up to {moved.abs().max().item():.2g}). Each rank's "
            f"shard is such a slice, so it would train differently from DDP + {name} without an "
            "error. Use an element-wise optimizer (SGD, Adam, AdamW, …), or for "
            f"{name} {INSTEAD.get(who, 'DDP')}")


# --- checkpoints ----------------------------------------------------------------------------------

def shard_state_dict(opt) -> dict:
    """This rank's slice of the state: the inner optimizer's ``state_dict`` plus the layout it belongs to."""
    sync_options(opt.param_groups, opt.optimizer.param_groups)
    inner = opt.optimizer.state_dict()
    return {"state": inner["state"], "param_groups": inner["param_groups"],
            SHARD_KEY: {"rank": opt.rank, "world_size": opt.world_size,
                        "parameters": opt.layout.signature(opt.param_groups)}}


def load_shard_state(opt, state_dict: dict) -> None:
    """Reload a slice saved by :func:`shard_state_dict` (``opt.shard_state_dict()``) on this same rank
    of the same layout."""
    saved, mine = state_dict[SHARD_KEY], {"rank": opt.rank, "world_size": opt.world_size,
                                          "parameters": opt.layout.signature(opt.param_groups)}
    if (saved.get("rank"), saved.get("world_size")) != (mine["rank"], mine["world_size"]):
        raise ValueError(f"state_dict holds the optimizer state of rank {saved.get('rank')} of "
                         f"{saved.get('world_size')}, but this is rank {opt.rank} of {opt.world_size}: load "
                         "each rank's own shard_state_dict(), or a whole state from consolidate_state_dict() "
                         "(it loads on any number of ranks)")
    if saved.get("parameters") != mine["parameters"]:
        raise ValueError("state_dict was saved for other parameters (shapes or requires_grad differ, "
                         "group by group); build the ZeroOptimizer on the same parameter groups")
    opt.optimizer.load_state_dict({"state": state_dict["state"], "param_groups": state_dict["param_groups"]})
    sync_options(opt.optimizer.param_groups, opt.param_groups)


def gather_full_state(opt, to: int | None) -> dict | None:
    """The whole state in ``torch.optim``'s format on rank ``to`` (``None``: on every rank).

    A collective: every rank sends its inner ``state_dict`` (as torch's ``ZeroRedundancyOptimizer``
    does); the receiving rank glues the pieces of every group back together and cuts them into
    one tensor per parameter. Returns ``None`` on the other ranks.
    """
    sync_options(opt.param_groups, opt.optimizer.param_groups)
    inner = opt.optimizer.state_dict()
    if opt.world_size == 1:
        per_rank = [inner]
    elif to is None:
        per_rank = [None] * opt.world_size
        dist.all_gather_object(per_rank, inner, group=opt.group)
    else:
        per_rank = [None] * opt.world_size if opt.rank == to else None
        dist.gather_object(inner, per_rank, dst=opt._global_rank(to), group=opt.group)
        if opt.rank != to:
            return None
    # every rank's inner state of group g, keyed by g (inner indices skip empty pieces)
    states = []
    for sd in per_rank:
        by_group = {}
        for g, group in enumerate(sd["param_groups"]):
            if group["params"]:
                by_group[g] = sd["state"].get(group["params"][0], {})
        states.append(by_group)

    layout, state, groups, index = opt.layout, {}, [], 0
    trainable_of = _trainable_by_group(opt)
    for g, group in enumerate(opt.param_groups):
        ids = list(range(index, index + len(group["params"])))
        index += len(group["params"])
        groups.append({**options(group), "params": ids})
        glo, ghi = layout.group_ranges[g]
        pieces = [(layout.piece(g, r), states[r].get(g, {})) for r in range(opt.world_size)]
        keys = sorted({k for _, s in pieces for k in s})
        if not keys:
            continue
        # [(id, param, offset), ...]; a parameter that never had a gradient has no state, as in torch.optim
        params = [t for t in trainable_of[g] if opt._used.get(id(t[1]), True)]
        if not params:
            continue
        for pid, _, _ in params:
            state[pid] = {}
        for key in keys:
            values = [((lo, hi), s[key]) for (lo, hi), s in pieces if key in s]
            if _per_element(key, values):
                full = torch.zeros(ghi - glo, dtype=values[0][1].dtype, device=values[0][1].device)
                for (lo, hi), v in values:
                    full[lo - glo:hi - glo] = v
                for pid, p, off in params:
                    state[pid][key] = full[off - glo:off - glo + p.numel()].view_as(p).clone()
            else:                                         # a scalar (Adam's step): one per group
                value = values[0][1]
                for pid, _, _ in params:
                    state[pid][key] = value.clone() if isinstance(value, torch.Tensor) else value
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def load_full_state(opt, state_dict: dict, *, groups: int | None = None) -> None:
    """Cut a whole state (``torch.optim``'s format) into this rank's pieces and load them.

    ``groups``: only the first that many groups come from ``state_dict`` (``add_param_group``: the
    new group starts fresh, as in ``torch.optim``); ``None``: all, and the counts must match.
    """
    saved_groups, full_state = state_dict.get("param_groups"), state_dict.get("state", {})
    n = len(opt.param_groups) if groups is None else groups
    if (not isinstance(saved_groups, list) or len(saved_groups) != n
            or any(len(s.get("params", ())) != len(g["params"]) for s, g in zip(saved_groups, opt.param_groups))):
        counts = [len(g["params"]) for g in opt.param_groups]
        raise ValueError(f"state_dict must hold {n} parameter group(s) with {counts[:n]} parameters, as "
                         "this ZeroOptimizer's (or the plain optimizer's on the same parameter groups) "
                         "state_dict() after consolidate_state_dict() returns")
    layout, trainable_of = opt.layout, _trainable_by_group(opt, [s["params"] for s in saved_groups])
    inner_groups, inner_state, index = [], {}, 0
    for g, group in enumerate(opt.param_groups):
        if g < n:
            group.update(options(saved_groups[g]))        # hyper-parameters come from the checkpoint
        lo, hi = layout.piece(g, opt.rank)
        if lo == hi:
            inner_groups.append({**options(group), "params": []})
            continue
        inner_groups.append({**options(group), "params": [index]})
        params = trainable_of[g] if g < n else []
        keys = sorted({k for pid, _, _ in params for k in full_state.get(pid, {})})
        glo = layout.group_ranges[g][0]
        piece_state = {}
        for key in keys:
            have = [(pid, p, off) for pid, p, off in params if key in full_state.get(pid, {})]
            first = full_state[have[0][0]][key]
            per_element = key != "step" and all(
                isinstance(full_state[pid][key], torch.Tensor) and full_state[pid][key].shape == p.shape
                for pid, p, _ in have)
            if per_element:
                flat = torch.zeros(layout.group_ranges[g][1] - glo, dtype=first.dtype)
                for pid, p, off in have:                  # a parameter without state starts from zeros
                    flat[off - glo:off - glo + p.numel()] = full_state[pid][key].reshape(-1)
                piece_state[key] = flat[lo - glo:hi - glo].clone()
            else:
                piece_state[key] = first
        if piece_state:
            inner_state[index] = piece_state
        index += 1
    opt.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})


def _trainable_by_group(opt, ids: list[list] | None = None) -> list[list[tuple]]:
    """Per group: ``(state index, parameter, offset in the flat buffer)`` of its trainable parameters."""
    offset_of = {id(p): off for p, off in zip(opt.layout.params, opt.layout.offsets)}
    out, index = [], 0
    for g, group in enumerate(opt.param_groups):
        group_ids = ids[g] if ids is not None and g < len(ids) else range(index, index + len(group["params"]))
        out.append([(pid, p, offset_of[id(p)]) for pid, p in zip(group_ids, group["params"]) if p.requires_grad])
        index += len(group["params"])
    return out


def _per_element(key: str, values: list) -> bool:
    """Is this state sliced like the parameters (one value per element of each piece)?"""
    sized = [isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == hi - lo for (lo, hi), v in values]
    if all(sized) and key != "step":
        return True
    if all(not isinstance(v, torch.Tensor) or v.dim() == 0 for _, v in values):
        return False
    raise ValueError(f"optimizer state {key!r} is neither one value per element nor a scalar; ZeroOptimizer "
                     "shards element-wise optimizers (SGD, Adam, AdamW, …), not ones with factored state")
