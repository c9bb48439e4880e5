"""Checkpoints in data-parallel training: save once on rank 0, atomically; load everywhere safely.

With DDP every rank holds the same parameters, so one copy is enough:

1) **rank 0 saves** — all ranks writing the same file at once would corrupt it (and waste I/O);
2) **atomically** — written to a temporary file in the same folder, flushed to disk, then renamed
   over the old checkpoint. A rename is all-or-nothing, so a crash mid-write (out of memory,
   a killed job, a full disk) leaves the previous checkpoint intact instead of a truncated file;
3) **barrier** — no rank goes on (to load the file, or to exit and let the job end) before the file
   is complete;
4) **load with** ``map_location`` — tensors saved on rank 0's ``cuda:0`` would otherwise all land on
   ``cuda:0`` in every process; map them to this process's device. And ``weights_only=True``: a
   checkpoint is data, and unpickling arbitrary objects from a file can run arbitrary code.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch
import torch.distributed as dist

__all__ = ["save_checkpoint", "load_checkpoint"]


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def _atomic_save(obj, path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # the temporary file must be in the same folder: a rename is only atomic within a file system
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        os.chmod(tmp, 0o666 & ~_umask())          # mkstemp makes it 0600; torch.save would not
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())                   # the bytes are on disk before the rename
        os.replace(tmp, path)                      # atomic: the old file or the new, never half
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):                 # make the rename itself durable (POSIX)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _umask() -> int:
    """This process's umask (read without changing it where Linux allows)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def save_checkpoint(obj, path: str | os.PathLike, *, group=None) -> None:
    """Rank 0 writes ``obj`` to ``path`` atomically; every rank then waits until it is on disk.

    A collective: **every** rank must call it (it ends with rank 0 broadcasting whether the save
    succeeded, which is also the barrier). If rank 0's save raises, rank 0 re-raises that error and
    every other rank raises a ``RuntimeError`` at once — nobody waits for the group's timeout.
    Outside a process group it simply saves.

    Args:
        obj: what to save, usually ``{"model": model.state_dict(), "optimizer": ..., "epoch": ...}``.
            Save the *unwrapped* model's ``state_dict`` (``ddp_model.module.state_dict()``): its keys
            have no ``module.`` prefix, so a plain model can load them.
        path: the checkpoint file. Its folder is created if needed.
        group: the process group whose rank 0 saves and whose ranks wait (default group if None).

    Example::

        >>> import os, tempfile, torch, gpucourse as gc
        >>> def checkpoint(rank, world_size, path):
        ...     model = torch.nn.Linear(2, 2)
        ...     gc.save_checkpoint({"model": model.state_dict(), "epoch": 3}, path)   # all ranks call it
        ...     state = gc.load_checkpoint(path, map_location="cpu")
        ...     return state["epoch"], sorted(state["model"])
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> gc.launch(checkpoint, 2, args=(path,))
        [(3, ['bias', 'weight']), (3, ['bias', 'weight'])]

    .. warning::
        Do not call it inside ``if rank == 0:`` — the barrier inside would wait forever for the
        other ranks (the *collective mismatch* trap). Call it on every rank; it decides itself
        who writes. (A save killed mid-write leaves a hidden ``.<name>.*.tmp`` file next to the
        checkpoint; the checkpoint itself is untouched and the leftover may be deleted.)
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} {path!r}")
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"path {path!r} is a directory; give a file name such as {path!r}/ckpt.pt")
    if not path or path.endswith(("/", os.sep)):
        raise ValueError(f"path must name a file, got {path!r}; give a file name such as "
                         f"{os.path.join(path or '.', 'ckpt.pt')!r}")
    if not _in_group():
        _atomic_save(obj, path)
        return
    error = None
    if dist.get_rank(group) == 0:
        try:
            _atomic_save(obj, path)
        except Exception as exc:  # noqa: BLE001 -- told to the others below, instead of leaving them
            error = exc                            # in a barrier until the group's timeout
    # rank 0's verdict, sent after the file is complete: it doubles as the barrier (nobody reads,
    # or exits, before the file is on disk) and lets a failed save stop every rank at once
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    ok = torch.tensor([0 if error else 1], dtype=torch.int32, device=device)
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast(ok, src=src, group=group)
    if error is not None:
        raise error
    if not ok.item():
        raise RuntimeError(f"rank 0 failed to save the checkpoint {path!r} (its own traceback says "
                           "why: disk full, no permission, an object torch.save cannot pickle, ...); "
                           "every rank stops here. Fix the cause and save again.")


def _default_map_location():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())   # this process's GPU
    return torch.device("cpu")


def load_checkpoint(path: str | os.PathLike, map_location=None, *, weights_only: bool = True):
    """Load a checkpoint onto this process's device, refusing to run code from the file.

    Args:
        path: the checkpoint file (written by :func:`save_checkpoint` or ``torch.save``).
        map_location: where tensors go, as for ``torch.load``: a device (``"cpu"``,
            ``torch.device("cuda", local_rank)``), or a mapping such as ``{"cuda:0": "cuda:1"}``.
            Default: this process's current CUDA device if CUDA is in use, else the CPU.
        weights_only: only tensors, numbers, strings and plain containers may be unpickled
            (``torch.load``'s safe mode). Set ``False`` only for files you trust.

    Returns:
        The saved object.

    Example::

        >>> import os, tempfile, torch, gpucourse as gc
        >>> path = os.path.join(tempfile.mkdtemp(), "w.pt")
        >>> gc.save_checkpoint({"w": torch.ones(2)}, path)            # no process group: just saves
        >>> gc.load_checkpoint(path, map_location="cpu")
        {'w': tensor([1., 1.])}

    .. warning::
        Without ``map_location``, ``torch.load`` puts every tensor back on the device it was
        saved from: with checkpoints saved by rank 0 on ``cuda:0``, all 8 processes of a node load
        a copy onto GPU 0 — out of memory, or silently slow. Load in every rank only after the
        saving rank's barrier (``save_checkpoint`` has it built in).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} {path!r}")
    path = os.fspath(path)
    if not os.path.exists(path):
        where = f" (rank {dist.get_rank()})" if _in_group() else ""
        raise FileNotFoundError(
            f"no checkpoint at {path!r}{where}. If rank 0 was saving it, load only after "
            "save_checkpoint() returned on every rank (it ends with a barrier); on several "
            "machines the path must be on a file system all of them share.")
    if map_location is None:
        map_location = _default_map_location()
    return torch.load(path, map_location=map_location, weights_only=weights_only)
