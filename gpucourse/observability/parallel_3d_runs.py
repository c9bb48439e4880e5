"""Running the 3-D capstone: the one-process reference, the launch from a parent, and the mesh's
coordinates — what :mod:`.parallel_3d`'s ranks are compared with and reported as."""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time

import torch

from ..data import TinyGPT, TinyText
from ..pipeline import SavedActivationMeter
from ..runtime import check_int, check_positive, launch
from .parallel_3d import MESH_DIMS, check_3d_args, train_3d

__all__ = ["train_reference_3d", "run_3d", "mesh_coordinates"]


def train_reference_3d(config: dict, *, steps: int = 20, batch_size: int = 8, lr: float = 3e-3, seed: int = 0,
                       bf16: bool = False, text_chars: int = 20_000) -> dict:
    """The same training in one process: the whole ``TinyGPT``, the whole batch, AdamW.

    Returns ``losses`` (per step), ``step_times``, ``step_time`` (median) and ``memory`` (bytes of
    params, grads, AdamW state, peak saved activations) — what :func:`train_3d` returns per rank, for one rank holding
    everything.

    Example::

        >>> cfg = dict(vocab_size=27, seq_len=8, num_layers=1, hidden=16, num_heads=2)
        >>> ref = train_reference_3d(cfg, steps=3, batch_size=4)
        >>> len(ref["losses"]), ref["memory"]["optimizer"] == 2 * ref["memory"]["params"]
        (3, True)

    .. warning::
        Time it in a process with one thread, like each rank of the 3-D run, or the comparison of
        step times flatters the single process.
    """
    check_int("steps", steps, 1)
    check_int("batch_size", batch_size, 1)
    check_positive("lr", lr)
    data = TinyText(text_chars, seed)
    torch.manual_seed(seed)
    model = TinyGPT(**config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times, peak_act = [], [], 0
    for step in range(steps):
        start = time.perf_counter()
        x, y = data.batch(batch_size, config["seq_len"], step)
        meter = SavedActivationMeter(ignore=model.parameters()) if step == 0 else None
        with meter or contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model.loss(x, y)
            peak_act = max(peak_act, meter.peak if meter else 0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    n = model.num_parameters()
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    return {"losses": losses, "step_times": times, "step_time": statistics.median(times),
            "memory": {"params": 4 * n, "grads": 4 * n, "optimizer": state, "activations": peak_act},
            "num_params": n}


def run_3d(config: dict, *, dp: int, tp: int, pp: int, steps: int = 20, batch_size: int = 8, chunks: int = 2,
           lr: float = 3e-3, seed: int = 0, bf16: bool = False, schedule: str = "1f1b",
           verbose: bool = False, timeout: float = 180.0) -> list[dict]:
    """Launch :func:`train_3d` on ``pp × dp × tp`` processes (checked here first); one dict per rank.

    Example::

        >>> cfg = dict(vocab_size=27, seq_len=4, num_layers=2, hidden=8, num_heads=2)
        >>> out = run_3d(cfg, dp=1, tp=2, pp=1, steps=2, batch_size=2)
        >>> [r["coords"]["tp"] for r in out], out[0]["losses"] == out[1]["losses"]
        ([0, 1], True)
    """
    check_3d_args(config, dp=dp, tp=tp, pp=pp, steps=steps, batch_size=batch_size, chunks=chunks, lr=lr,
                  schedule=schedule, seed=seed)
    fn = functools.partial(train_3d, config=dict(config), dp=dp, tp=tp, pp=pp, steps=steps,
                           batch_size=batch_size, chunks=chunks, lr=lr, seed=seed, bf16=bf16,
                           schedule=schedule, verbose=verbose)
    return launch(fn, pp * dp * tp, timeout=timeout)


def _coordinates_worker(rank, world_size, shape, names):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    n, coords = 1, []
    for size in shape:
        n *= size
    # no start barrier: a FakeStore has no add() (torch 2.11 calls it when TORCH_DIST_INIT_BARRIER=1,
    # which launch sets for real groups; seen on a GPU machine), and a fake group has no one to wait for
    os.environ["TORCH_DIST_INIT_BARRIER"] = "0"
    for r in range(n):     # the fake backend: a process group of n "ranks" that never talks
        dist.init_process_group("fake", rank=r, world_size=n, store=FakeStore())
        try:
            coords.append(tuple(init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
                                .get_coordinate()))
        finally:
            dist.destroy_process_group()
    return coords


def mesh_coordinates(shape, names=MESH_DIMS) -> list[tuple[int, ...]]:
    """``init_device_mesh``'s own coordinate of every rank of a mesh of ``shape``, rank order.

    Computed by PyTorch itself — ``DeviceMesh.get_coordinate()`` — in one child process with the
    *fake* process-group backend (no real ranks), so a 16-GPU mesh can be inspected on a laptop.

    Args:
        shape: sizes of the mesh's dims, outermost first, e.g. ``(pp, dp, tp)``.
        names: the dims' names (as many as ``shape``).

    Example::

        >>> mesh_coordinates((2, 3), ("dp", "tp"))
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]

    .. warning::
        ``torch.testing._internal`` is PyTorch's test support, not public API; a future release
        may move the fake backend.
    """
    shape = tuple(shape)
    if not shape or len(shape) != len(tuple(names)):
        raise ValueError(f"shape {shape} and names {tuple(names)} must be non-empty and of one length")
    for i, size in enumerate(shape):
        check_int(f"shape[{i}]", size, 1)
    return launch(_coordinates_worker, 1, args=(shape, tuple(names)), init_process_group=False, timeout=60)[0]
