"""``python -m gpucourse doctor``: can the course run on this machine, and on what hardware?

It reports what every chapter depends on — PyTorch and its build, CUDA devices and the
``CUDA_VISIBLE_DEVICES`` mapping, communication backends, CPU cores, bf16 support — then proves the
multi-process machinery works with a real 2-process gloo all-reduce, and ends with a one-line verdict.
"""

from __future__ import annotations

import os
import platform
import sys
import textwrap
import time

import torch
import torch.distributed as dist

from .cpu_features import bf16_hardware_note, cpu_supports_bf16, has_bf16_units
from .devices import cpu_cores, visible_devices
from .launcher import launch
from .processes import warm_parent

__all__ = ["doctor", "cpu_supports_bf16"]


def _smoke(rank: int, world_size: int) -> float:
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    return float(t[0])


def doctor(smoke_test: bool = True, file=None) -> bool:
    """Print the report; return True when the course can run here."""
    out = file or sys.stdout

    def say(label: str, value: object) -> None:
        print(f"{label:<24}{value}", file=out)

    problems: list[str] = []
    say("python", f"{platform.python_version()} ({sys.executable})")
    say("platform", f"{platform.system()} {platform.machine()}")
    cuda_build = torch.version.cuda or "none (CPU-only build)"
    say("torch", f"{torch.__version__} (CUDA in build: {cuda_build})")
    try:
        import torchvision

        say("torchvision", torchvision.__version__)
    except Exception as e:  # noqa: BLE001 - report, don't crash
        say("torchvision", f"NOT importable: {e}")
        problems.append("torchvision does not import")
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    say("CUDA devices", n_gpu)
    for i in range(n_gpu):
        props = torch.cuda.get_device_properties(i)
        say(f"  cuda:{i}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB")
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        say("CUDA_VISIBLE_DEVICES", "not set (every GPU visible under its own id)")
    else:
        try:
            say("CUDA_VISIBLE_DEVICES", f"{spec!r} -> logical:physical {visible_devices(spec)}")
        except ValueError as e:
            say("CUDA_VISIBLE_DEVICES", f"{spec!r} is malformed: {e}")
            problems.append("CUDA_VISIBLE_DEVICES is malformed")
    backends = {name: getattr(dist, f"is_{name}_available")() for name in ("gloo", "nccl", "mpi")}
    listed = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in backends.items()
                       if not (k == "nccl" and v and not n_gpu))
    if backends["nccl"] and not n_gpu:      # NCCL only moves data between CUDA devices
        listed += "; nccl compiled in, unusable: no CUDA device"
    say("backends", listed)
    if not backends["gloo"]:
        problems.append("gloo backend unavailable")
    say("CPU cores", f"{cpu_cores()} usable (os.cpu_count()={os.cpu_count()})")
    say("torch threads", torch.get_num_threads())
    bf16 = cpu_supports_bf16()
    say("CPU bf16", ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in bf16.items()))
    note = ("" if has_bf16_units(bf16) else "NOTE: ") + bf16_hardware_note(bf16)
    print(textwrap.fill(note, 100, initial_indent=" " * 24, subsequent_indent=" " * 24), file=out)
    if smoke_test and backends["gloo"]:
        warm_parent()  # one-off imports that every later launch reuses; not part of the timing
        start = time.perf_counter()
        try:
            result = launch(_smoke, 2, timeout=60)
            elapsed = time.perf_counter() - start
            ok = result == [3.0, 3.0]
            say("2-process all-reduce", f"{'ok' if ok else 'WRONG ' + str(result)} in {elapsed:.2f} s (gloo, loopback)")
            if not ok:
                problems.append("all-reduce returned a wrong sum")
        except Exception as e:  # noqa: BLE001 - report, don't crash
            say("2-process all-reduce", f"FAILED: {type(e).__name__}: {str(e).splitlines()[0]}")
            problems.append("2-process gloo all-reduce failed")
    if problems:
        print(f"verdict: NOT READY — {'; '.join(problems)}", file=out)
        return False
    where = (f"{n_gpu} CUDA GPU(s): chapters use CUDA/NCCL where it helps" if n_gpu
             else "CPU only: chapters use gloo processes and CPU virtual devices")
    print(f"verdict: READY — {where}", file=out)
    return True
