"""Two CPU-bound workloads that differ in one thing: whether they hold Python's GIL.

* :func:`python_work` — a pure-Python loop. The interpreter executes every step, holding the
  GIL (global interpreter lock) throughout, so two threads running it take turns.
* :func:`torch_work` — a chain of matrix products. Each product runs in compiled code that
  *releases* the GIL, so two threads running it can use two cores at once.

Both take a size ``n`` proportional to the time they take, so ``n`` can be split into chunks:
``python_work(n)`` costs the same as ``python_work(n // 2)`` twice.
"""

from __future__ import annotations

import functools

import torch

from ..runtime import check_int

__all__ = ["python_work", "torch_work"]


def python_work(n: int) -> int:
    """A pure-Python loop of ``n`` steps (about 40 ns each on a recent CPU); holds the GIL.

    Args:
        n: number of loop steps (>= 0).

    Returns:
        ``sum(i * i % 7 for i in range(n))`` — a result, so the work cannot be skipped.

    Example::

        >>> python_work(10)
        19

    .. warning::
        Threads cannot speed this up in CPython (one GIL); processes can.
    """
    check_int("n", n, 0)
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


@functools.lru_cache(maxsize=8)
def _orthogonal(size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(size, size, generator=g, dtype=torch.float64))
    return q.float()      # orthogonal: repeated products neither blow up nor vanish


def torch_work(n: int, size: int = 128, seed: int = 0) -> float:
    """``n`` products of a ``(size, size)`` matrix: ``x ← x @ Q``; releases the GIL while multiplying.

    ``Q`` is orthogonal, so ``x`` keeps its norm however long the chain (no overflow, no slow
    denormal numbers): the time per step stays constant and the result is checkable.

    Args:
        n: number of matrix products (>= 0); ``2 * size**3`` floating-point operations each.
        size: matrix side (>= 1). At 128 one product takes ~30 µs on one core: long enough that
            the GIL is released most of the time, short enough to split finely.
        seed: picks ``Q`` (and the start ``x = Q``).

    Returns:
        the squared Frobenius norm of the final ``x`` (``size`` up to rounding, for any ``n``).

    Example::

        >>> round(torch_work(50, size=16), 3)
        16.0

    .. warning::
        With tiny matrices (``size`` ≲ 64) the Python overhead around each op — during which the
        GIL is held — dominates, and threads stop helping. And torch may itself use several
        threads per op; when you parallelise with your own threads, run with
        :func:`~gpucourse.intra_op_threads` ``(1)``.
    """
    check_int("n", n, 0)
    check_int("size", size, 1)
    q = _orthogonal(size, seed)
    x = q
    for _ in range(n):
        x = x @ q
    return float((x * x).sum())
