"""Surviving a dead rank: checkpoint *everything* the next step depends on, resume bit-identically.

A job of hundreds of processes loses one to a hardware fault every few hours. ``torchrun
--max-restarts=N`` restarts the whole group when a rank dies; the script must then continue from
its latest checkpoint as if nothing happened. "As if nothing happened" means the same bits:

1) **model** parameters and buffers;
2) **optimizer** state (momentum, Adam's moments, the step count);
3) **loss scaler** state (``GradScaler``/``LossScaler``: the current scale and its growth counter —
   restart at 65536 instead of the learned scale and the first steps overflow or underflow);
4) **data position**: the sampler's epoch (its shuffle) and how many samples of it were consumed
   — otherwise the resumed run re-trains on the start of the epoch;
5) **RNG states** of every rank: torch CPU (and CUDA), Python's ``random``, NumPy — dropout, data
   augmentation and ``torch.randperm`` draw from them;
6) the **step** to continue from.

Rank 0 writes the file atomically (:func:`~gpucourse.save_checkpoint`: a crash mid-write leaves
the previous checkpoint intact); RNG states differ per rank, so they are gathered to rank 0 first
and every rank takes its own back on load.
"""

from __future__ import annotations

import os
import random
import re

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from ..distributed import load_checkpoint, save_checkpoint
from ..runtime import check_int, check_type

__all__ = [
    "ResumableSampler",
    "latest_checkpoint",
    "load_training_state",
    "rng_states",
    "save_training_state",
    "set_rng_states",
]


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that remembers how far into the epoch training got.

    The training loop calls :meth:`advance` with each consumed batch's size; :meth:`state_dict`
    is ``{"epoch", "position"}`` and, once loaded, the next iteration skips the consumed samples
    of that epoch's shuffle. Arguments as for ``torch.utils.data.DistributedSampler``.

    Example::

        >>> s = ResumableSampler(range(8), num_replicas=1, rank=0, shuffle=True, seed=0)
        >>> s.set_epoch(1)
        >>> full = list(s)
        >>> s.advance(3)
        >>> resumed = ResumableSampler(range(8), num_replicas=1, rank=0, shuffle=True, seed=0)
        >>> resumed.load_state_dict(s.state_dict())
        >>> list(resumed) == full[3:]
        True

    .. warning::
        Count batches the *training step consumed*, not what the ``DataLoader`` fetched: with
        workers and prefetching the loader runs ahead of the step.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        """A new epoch: new shuffle, from its start."""
        super().set_epoch(epoch)
        self.position = 0

    def advance(self, num_samples: int) -> None:
        """``num_samples`` more samples of this epoch were trained on."""
        self.position += check_int("num_samples", num_samples, 0)

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.position:])

    def __len__(self) -> int:
        return self.num_samples - self.position

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        super().set_epoch(check_int("epoch", state["epoch"], 0))
        self.position = check_int("position", state["position"], 0, maximum=self.num_samples)


def rng_states() -> dict:
    """This process's random number generator states, as tensors and plain values.

    Everything in it loads with ``torch.load(..., weights_only=True)`` (NumPy's key array is stored
    as a tensor).

    Example::

        >>> import torch
        >>> state = rng_states()
        >>> a = torch.rand(2)
        >>> set_rng_states(state)
        >>> torch.equal(a, torch.rand(2))
        True

    .. warning::
        CUDA has one generator per device: restore them *after* ``torch.cuda.set_device``.
    """
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(),
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))}


def set_rng_states(state: dict) -> None:
    """Restore what :func:`rng_states` returned."""
    check_type("state", state, dict)
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _gather_rng(group) -> list[dict]:
    mine = rng_states()
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def save_training_state(path, *, model, optimizer, step: int, sampler=None, scaler=None, group=None) -> None:
    """Checkpoint all that resuming bit-identically needs (a collective: call it on every rank).

    Args:
        path: the checkpoint file (rank 0 writes it atomically).
        model: the model, or DDP wrapper (its ``.module`` is saved).
        optimizer: the optimizer.
        step: steps completed; training resumes at this step.
        sampler: a :class:`ResumableSampler` (or anything with ``state_dict``), optional.
        scaler: ``torch.amp.GradScaler`` or :class:`~gpucourse.LossScaler`, optional.
        group: the process group (default group).

    Example::

        >>> import os, tempfile, torch, gpucourse as gc
        >>> model = torch.nn.Linear(3, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> path = os.path.join(tempfile.mkdtemp(), "step_3.pt")
        >>> gc.save_training_state(path, model=model, optimizer=opt, step=3)
        >>> gc.load_training_state(path, model=torch.nn.Linear(3, 1), optimizer=opt)
        3

    .. warning::
        Leaving out any item (the scaler, the sampler position, one rank's RNG) still *runs* — the
        resumed loss curve just quietly differs from the uninterrupted one. Test resume by
        comparing a crashed-and-resumed run with an uncrashed one, bit for bit.
    """
    step = check_int("step", step, 0)
    module = model.module if hasattr(model, "module") else model
    state = {"step": step, "model": module.state_dict(), "optimizer": optimizer.state_dict(),
             "rng": _gather_rng(group)}
    if sampler is not None:
        state["sampler"] = sampler.state_dict()
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    save_checkpoint(state, path, group=group)


def load_training_state(path, *, model, optimizer, sampler=None, scaler=None, map_location="cpu") -> int:
    """Restore what :func:`save_training_state` wrote, on this rank; returns the step to continue at.

    Args:
        path: the checkpoint file.
        model, optimizer, sampler, scaler: restored in place (same objects as when saving).
        map_location: where tensors go (``torch.device("cuda", local_rank)`` on GPUs).
    """
    state = load_checkpoint(path, map_location=map_location)
    module = model.module if hasattr(model, "module") else model
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for name, obj in (("sampler", sampler), ("scaler", scaler)):
        if obj is not None:
            if name not in state:
                raise ValueError(f"{path!r} has no {name} state; it was saved without {name}=")
            obj.load_state_dict(state[name])
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank >= len(state["rng"]):
        raise ValueError(f"{path!r} holds RNG states of {len(state['rng'])} ranks; this is rank {rank}. "
                         "Bit-identical resume needs the same world size.")
    set_rng_states(state["rng"][rank])
    return state["step"]


def latest_checkpoint(folder, pattern: str = r"step_(\d+)\.pt") -> str | None:
    """The checkpoint in ``folder`` with the highest step number, or ``None``.

    Example::

        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> for name in ("step_5.pt", "step_10.pt", ".step_15.pt.x.tmp", "notes.txt"):
        ...     _ = open(os.path.join(d, name), "w").write("")
        >>> os.path.basename(latest_checkpoint(d))
        'step_10.pt'
    """
    check_type("folder", folder, (str, os.PathLike))
    if not os.path.isdir(folder):
        return None
    found = [(int(m.group(1)), name) for name in os.listdir(folder)
             if (m := re.fullmatch(pattern, name))]
    return os.path.join(folder, max(found)[1]) if found else None
