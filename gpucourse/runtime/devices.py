"""Which devices a program sees: ``CUDA_VISIBLE_DEVICES`` remapping, and CPU "virtual devices".

On a GPU machine, ``CUDA_VISIBLE_DEVICES="0,3"`` hides every GPU except physical 0 and 3 and
*renumbers* the survivors: inside the program they are ``cuda:0`` and ``cuda:1``. The variable is
read once, when CUDA initialises in the process, so it must be set before the first CUDA call —
best in the shell (``CUDA_VISIBLE_DEVICES=0,3 python train.py``).

On a CPU-only machine the course stands in for GPUs with *virtual devices*: the labels
``cpu:0, cpu:1, ...``. They all live in the same RAM, but the course's DataParallel gives each one its
own worker thread, so work placed on different virtual devices really runs at the same time.
"""

from __future__ import annotations

import os

import torch

from .validate import check_int

__all__ = ["visible_devices", "virtual_devices", "default_backend", "rank_device"]


def visible_devices(spec: str | None) -> dict[int, int]:
    """Map logical CUDA ids to physical ones for a ``CUDA_VISIBLE_DEVICES`` value.

    Args:
        spec: the variable's value, e.g. ``"0,3"``. ``None`` means "not set": *every* GPU this
            machine has is visible under its own id (on a machine without GPUs that is ``{}``,
            because there is nothing to list — not because the variable hid anything).

    Returns:
        ``{logical id: physical id}`` — what ``cuda:<logical>`` in the program really is.

    Like CUDA itself, the list ends at the first negative id: ``"-1"`` hides every GPU (a common
    idiom) and ``"0,-1,2"`` is just ``{0: 0}``.

    Example::

        >>> visible_devices("0,3")
        {0: 0, 1: 3}
        >>> visible_devices("2, 1")      # order matters: logical 0 is physical 2
        {0: 2, 1: 1}
        >>> visible_devices(None) == {i: i for i in range(torch.cuda.device_count())}  # unset: all
        True
        >>> visible_devices("")          # set but empty: no GPU at all
        {}
        >>> visible_devices("1,x")
        Traceback (most recent call last):
        ...
        ValueError: CUDA_VISIBLE_DEVICES entry 'x' (position 1 of '1,x') is not a device index; expected comma-separated integers such as '0,3'

    .. warning::
        Setting ``os.environ["CUDA_VISIBLE_DEVICES"]`` in a script only works *before* CUDA is
        initialised in that process (before the first ``.cuda()``, ``torch.cuda.device_count()`` on
        some builds, or any library that touches the GPU). Afterwards it is silently ignored.
    """
    if spec is None:
        return {i: i for i in range(torch.cuda.device_count())}
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str like '0,3' or None, got {type(spec).__name__} {spec!r}")
    if spec.strip() == "":
        return {}
    mapping: dict[int, int] = {}
    for position, raw in enumerate(spec.split(",")):
        entry = raw.strip()
        if entry.startswith("GPU-") or entry.startswith("MIG-"):
            raise ValueError(
                f"CUDA_VISIBLE_DEVICES entry {entry!r} is a device UUID; this helper only maps "
                "integer ids (run `nvidia-smi -L` to see which index has that UUID)")
        try:
            physical = int(entry)
        except ValueError:
            raise ValueError(
                f"CUDA_VISIBLE_DEVICES entry {entry!r} (position {position} of {spec!r}) is not a "
                "device index; expected comma-separated integers such as '0,3'") from None
        if physical < 0:  # CUDA stops reading the list at the first invalid id
            break
        if physical in mapping.values():
            raise ValueError(f"CUDA_VISIBLE_DEVICES lists physical device {physical} twice in {spec!r}")
        mapping[len(mapping)] = physical
    return mapping


def virtual_devices(n: int) -> list[torch.device]:
    """``n`` devices to run data parallelism on.

    CUDA devices when at least ``n`` are visible, otherwise ``n`` CPU *virtual devices*
    ``cpu:0 … cpu:{n-1}`` (labels that the course's DataParallel maps to worker threads).

    Example::

        >>> devs = virtual_devices(2)
        >>> [str(d) for d in devs] in (["cuda:0", "cuda:1"], ["cpu:0", "cpu:1"])
        True
    """
    check_int("n", n, 1, hint=" device")
    if torch.cuda.is_available() and torch.cuda.device_count() >= n:
        return [torch.device("cuda", i) for i in range(n)]
    return [torch.device("cpu", i) for i in range(n)]


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset/cgroups affinity where the OS tells).

    The course sizes its demos with it: on 2 cores, 2 workers is the most that can run at once.

    Example::

        >>> cpu_cores() >= 1
        True
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_SAID: set = set()   # (nprocs, gpus) already explained in this process: once is enough


def default_backend(nprocs: int | None = None, *, say: bool = True) -> str:
    """The ``torch.distributed`` backend a lesson should use on this machine.

    ``"nccl"`` when CUDA devices are visible *and* this PyTorch build has NCCL (the usual
    multi-GPU case), otherwise ``"gloo"`` (CPU tensors, or a build without NCCL such as
    Windows or macOS). The course's launch cells pass ``backend=gc.default_backend(n)``, so the
    same cell runs gloo on a laptop and NCCL on a GPU machine.

    Args:
        nprocs: the ranks this machine will run, one GPU each. NCCL needs a GPU per rank (ranks
            that share one GPU make NCCL fail or hang), so with fewer GPUs than ``nprocs`` the
            answer is ``"gloo"``, on the CPU — and, with ``say``, one printed line says why. Leave
            it out to ask only "is this a GPU machine?".
        say: print that line when a GPU machine falls back to gloo, once per process and number
            of ranks (a script prints it on one rank only).

    Returns:
        ``"nccl"`` or ``"gloo"``.

    Example::

        >>> default_backend() in ("gloo", "nccl")
        True
        >>> import torch
        >>> torch.cuda.is_available() or default_backend(2) == "gloo"   # no GPU -> gloo
        True

    .. warning::
        NCCL only moves CUDA tensors: code that picks ``"nccl"`` must also put every tensor it
        sends on ``torch.device("cuda", local_rank)`` (and call ``torch.cuda.set_device`` first);
        :func:`rank_device` gives that device. Asking for CUDA availability initialises the CUDA
        driver in this process, so call this *after* setting ``CUDA_VISIBLE_DEVICES``.
    """
    import torch.distributed as dist

    if nprocs is not None:
        check_int("nprocs", nprocs, 1)
    if not (torch.cuda.is_available() and torch.cuda.device_count() > 0 and dist.is_nccl_available()):
        return "gloo"
    gpus = torch.cuda.device_count()
    if nprocs is not None and gpus < nprocs:
        if say and (nprocs, gpus) not in _SAID:
            _SAID.add((nprocs, gpus))
            print(f"gc.default_backend({nprocs}): {nprocs} ranks but {gpus} CUDA GPU(s) here — NCCL "
                  "needs one GPU per rank (ranks sharing a GPU make it fail or hang), so these ranks "
                  "use gloo, on the CPU")
        return "gloo"
    return "nccl"


def rank_device(group=None) -> torch.device:
    """The device this rank's tensors go on: ``cuda:<local rank>`` under NCCL, else the CPU.

    It follows the process group's backend, not the hardware: a gloo group on a GPU machine (the
    fallback of :func:`default_backend`) keeps its tensors on the CPU, where gloo's collectives
    run. Under NCCL it is the device ``torch.cuda.set_device`` chose (``gc.launch`` and the course's
    scripts set ``LOCAL_RANK``'s GPU). Outside a process group: the CPU.

    Args:
        group: the process group whose backend decides (default: the default group).

    Example::

        >>> rank_device()                     # no process group in this process
        device(type='cpu')
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
