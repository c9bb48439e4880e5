"""Distributed checkpoints (DCP): every rank writes its own shard; any number of ranks reads them.

``torch.save`` of a full state dict needs the *whole* model in one process: with FSDP/ZeRO the
parameters and optimizer state are spread over N ranks precisely because they do not fit in one,
and gathering them to rank 0 costs N× the memory and one writer's bandwidth. ``torch.distributed
.checkpoint`` instead:

1) **save**: each rank writes its own shards (``__<rank>_0.distcp``) in parallel, rank 0 adds a
   ``.metadata`` file saying which slice of which tensor is where;
2) **load**: each rank asks for the slices *its* sharding needs and reads just those — on any number
   of ranks: 2 → 3 (resharding), or 2 → 1 process with a plain model (no process group).

``get_state_dict``/``set_state_dict`` (``torch.distributed.checkpoint.state_dict``) give the model
and optimizer state in a form DCP can reshard, with or without FSDP.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from ..runtime import check_type, rank_device

__all__ = ["dcp_load", "dcp_save", "full_model_state", "fully_shard_model"]


def fully_shard_model(model: torch.nn.Module, mesh=None) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` every child with parameters, then the root (chapter 08's ZeRO-3).

    Args:
        model: the plain model, the same initial weights on every rank.
        mesh: a 1-D ``DeviceMesh`` (default: all ranks, on this group's device —
            :func:`~gpucourse.rank_device`: CUDA under NCCL, the CPU under gloo, also on a GPU
            machine).

    Returns:
        the model, now with ``DTensor`` parameters (dim 0 split over the ranks).

    Example::

        >>> import torch, gpucourse as gc
        >>> def shapes(rank, world_size):
        ...     torch.manual_seed(0)
        ...     model = gc.fully_shard_model(gc.MLP(4, 5, 2))
        ...     return [tuple(p.to_local().shape) for p in model.parameters()]
        >>> gc.launch(shapes, 2)        # 5 rows of the first weight: 3 + 2
        [[(3, 4), (3,), (1, 5), (1,)], [(2, 4), (2,), (1, 5), (1,)]]

    .. warning::
        Every rank must wrap the *same* modules in the same order: ``fully_shard`` registers
        collectives, and a rank that wraps differently hangs the others in their first forward.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    check_type("model", model, torch.nn.Module)
    if mesh is None:
        mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def dcp_save(checkpoint_dir, model: torch.nn.Module, optimizer=None) -> None:
    """Save model (and optimizer) state with DCP: every rank writes its own shard.

    Args:
        checkpoint_dir: a folder (created); holds one ``.distcp`` file per rank and ``.metadata``.
        model: sharded (``fully_shard``) or plain.
        optimizer: optional.

    Example::

        >>> import os, tempfile, torch, gpucourse as gc
        >>> folder = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = torch.manual_seed(0); model = gc.MLP(4, 5, 2)
        >>> gc.dcp_save(folder, model)                     # one process, no group: still works
        >>> other = gc.MLP(4, 5, 2); gc.dcp_load(folder, other)
        >>> all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
        True

    .. warning::
        A collective on every rank of the group: calling it ``if rank == 0`` hangs (rank 0 waits for
        the others' shards). All ranks need the same ``checkpoint_dir`` on a shared file system.
    """
    import torch.distributed.checkpoint as dcp

    check_type("checkpoint_dir", checkpoint_dir, (str, os.PathLike))
    state = _state(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp.save(state, checkpoint_id=os.fspath(checkpoint_dir),
                 no_dist=not (dist.is_available() and dist.is_initialized()))


def dcp_load(checkpoint_dir, model: torch.nn.Module, optimizer=None) -> None:
    """Load a DCP checkpoint into ``model`` (and ``optimizer``) in place — resharding as needed.

    The model may be sharded over any number of ranks (or be a plain model in one process): each
    rank reads the slices its own parameters cover.

    Args:
        checkpoint_dir: the folder :func:`dcp_save` wrote.
        model, optimizer: the same architecture (and optimizer class) as saved.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_state_dict,
    )

    check_type("checkpoint_dir", checkpoint_dir, (str, os.PathLike))
    if not os.path.exists(os.path.join(checkpoint_dir, ".metadata")):
        raise FileNotFoundError(f"no DCP checkpoint in {os.fspath(checkpoint_dir)!r} (its .metadata "
                                "is missing); write one with dcp_save on every rank")
    state = _state(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp.load(state, checkpoint_id=os.fspath(checkpoint_dir),
                 no_dist=not (dist.is_available() and dist.is_initialized()))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) parameters and buffers on the CPU, on every rank — to compare runs.

    Example::

        >>> import torch, gpucourse as gc
        >>> sorted(gc.full_model_state(gc.MLP(2, 3, 1)))
        ['0.bias', '0.weight', '2.bias', '2.weight']

    .. warning::
        It gathers the whole model into every process: fine for checking a small model, the very
        thing DCP exists to avoid for a large one.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cpu_offload=True would hand the full tensors to rank 0 only; gather on every rank, then copy
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _state(model: torch.nn.Module, optimizer) -> dict:
    """``{"model": …, "optimizer": …}`` as DCP saves and loads it (each rank's own shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}
