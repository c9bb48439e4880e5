"""SISD vs SIMD: one number at a time in a Python loop, or many per instruction in a vectorised op.

Flynn's taxonomy sorts computers by how many instruction streams act on how many data streams:

* **SISD** (single instruction, single data) — the classic von Neumann loop: fetch an
  instruction, decode it, execute it on one value, repeat. A Python ``for`` loop over numbers is
  SISD — with an interpreter's dozens of machine instructions around every arithmetic step.
* **SIMD** (single instruction, multiple data) — one instruction on a whole vector register:
  AVX-512 adds 16 float32 numbers at once. ``torch`` and NumPy ops run SIMD code over the whole
  tensor ("vectorised").
* **MISD** — several instruction streams on the *same* data; rare (redundant flight computers
  that cross-check each other).
* **MIMD** — independent instruction streams on independent data: several cores, each running
  its own thread or process (:mod:`gpucourse.parallel`), several GPUs, several machines.

:func:`dot_loop` is the SISD baseline; :func:`time_with_cpu_capability` separates the two gains of
a vectorised op — skipping the interpreter, and SIMD instructions — by running the *same* torch op
with SIMD code paths switched off (``ATEN_CPU_CAPABILITY=default``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from ..runtime import Timing, check_int

__all__ = ["dot_loop", "cpu_capability", "time_with_cpu_capability"]


def dot_loop(a: torch.Tensor, b: torch.Tensor) -> float:
    """The dot product of two 1-D tensors, one multiply-add at a time in Python (SISD).

    Args:
        a, b: 1-D tensors of the same length.

    Example::

        >>> import torch
        >>> dot_loop(torch.tensor([1., 2., 3.]), torch.tensor([4., 5., 6.]))
        32.0

    .. warning::
        This is the slow way on purpose, the baseline of the lesson: ``torch.dot(a, b)`` is the
        same sum computed by vectorised code, typically hundreds of times faster. (The loop adds
        in float64, so the two agree only to float32 rounding.)
    """
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        raise TypeError(f"a and b must be tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.dim() != 1 or a.shape != b.shape:
        raise ValueError(f"a and b must be 1-D tensors of the same length, got shapes "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    total = 0.0
    for x, y in zip(a.tolist(), b.tolist()):
        total += x * y
    return total


def cpu_capability() -> str:
    """The SIMD instruction set torch's CPU kernels use in this process (``"AVX512"``, ``"AVX2"``,
    ``"DEFAULT"``, ``"SVE256"`` …).

    Example::

        >>> isinstance(cpu_capability(), str)
        True
    """
    return torch.backends.cpu.get_cpu_capability()


_SCRIPT = r"""
import json, statistics, time, torch
torch.set_num_threads(1)
op, numel, repeats = {op!r}, {numel}, {repeats}
g = torch.Generator().manual_seed(0)
a, b = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
out = torch.empty(numel)
run = {{"mul": lambda: torch.mul(a, b, out=out), "sum": lambda: a.sum(),
        "exp": lambda: torch.exp(a, out=out)}}[op]
for _ in range(3):
    run()
times = []
for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
print(json.dumps(dict(capability=torch.backends.cpu.get_cpu_capability(), times=times)))
"""

_OPS = ("mul", "sum", "exp")


def time_with_cpu_capability(capability: str, *, op: str = "sum", numel: int = 1 << 16,
                             repeats: int = 50, timeout: float = 120.0) -> Timing:
    """Time one torch op on ``numel`` float32 numbers in a fresh process restricted to ``capability``.

    torch picks its CPU kernels' instruction set once, at start-up, from the environment variable
    ``ATEN_CPU_CAPABILITY`` (``default``, ``avx2``, ``avx512`` on x86; ``default``, ``sve256`` on
    ARM). ``default`` is the build's baseline code — no AVX — so comparing it with this machine's
    best shows what SIMD instructions alone are worth, with the interpreter out of the picture.

    Args:
        capability: the value for ``ATEN_CPU_CAPABILITY``; one this CPU lacks falls back to the
            best it has (the returned name says what really ran).
        op: ``"sum"`` (a reduction), ``"mul"`` or ``"exp"`` (element-wise).
        numel: tensor length (>= 1); the default 64 Ki floats fit in the L2 cache.
        repeats: timed calls (>= 1); one intra-op thread.
        timeout: seconds for the whole child process (it imports torch: ~1–3 s).

    Returns:
        a :class:`~gpucourse.Timing` named ``"<op> with <capability that ran>"``.

    Example::

        >>> t = time_with_cpu_capability("default", op="sum", numel=1024, repeats=3)
        >>> t.name, len(t.times)
        ('sum with DEFAULT', 3)

    .. warning::
        ``default`` is not strictly one-number-at-a-time: on x86-64 the compiler may still use
        128-bit SSE2 (4 floats) in the baseline code. The ratio measured is "this machine's best
        SIMD vs the portable baseline", a lower bound on SIMD vs true SISD.
    """
    if not isinstance(capability, str) or not capability.strip():
        raise ValueError(f"capability must be a name such as 'default' or 'avx2', got {capability!r}")
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}, got {op!r}")
    for name, value in (("numel", numel), ("repeats", repeats)):
        check_int(name, value, 1)
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability.lower(), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(op=op, numel=numel, repeats=repeats)],
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the timing process for ATEN_CPU_CAPABILITY={capability!r} failed "
                           f"(exit code {proc.returncode}):\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return Timing(f"{op} with {result['capability']}", result["times"])
