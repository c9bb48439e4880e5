"""The package's one argument checker: every public function checks its input through these.

A learner who passes a wrong value gets a ``TypeError`` (wrong kind) or ``ValueError`` (right
kind, wrong value) whose message names the argument, the value, and what is allowed — the style of
``torch.utils.data.DistributedSampler`` — instead of a traceback from deep inside PyTorch. Checks
use ``raise``, never ``assert`` (``python -O`` strips asserts).

Example::

    >>> check_int("chunks", 4, minimum=1)
    4
    >>> check_int("chunks", 0, minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: chunks must be >= 1, got 0
    >>> check_choice("stage", 3, (1, 2))
    Traceback (most recent call last):
    ...
    ValueError: stage must be one of 1, 2; got 3
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["check_int", "check_number", "check_positive", "check_choice", "check_tensor", "check_type"]


def _kind(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def check_int(name: str, value: Any, minimum: int | None = None, *, maximum: int | None = None,
              hint: str = "") -> int:
    """``value`` must be an ``int`` (not a ``bool``) within ``[minimum, maximum]``; returns it.

    ``hint`` is appended to the range error, e.g. ``" (the number of micro-batches)"``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {_kind(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}{hint}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}{hint}, got {value}")
    return value


def check_number(name: str, value: Any, minimum: float | None = None, *, maximum: float | None = None,
                 finite: bool = True) -> float:
    """``value`` must be a real number (int or float, not bool, not NaN; finite unless told) in range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {_kind(value)}")
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_positive(name: str, value: Any, *, finite: bool = True) -> float:
    """``value`` must be a number ``> 0`` (a time, a size, a scale)."""
    check_number(name, value, finite=finite)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """``value`` must be one of ``choices``; the message lists them."""
    choices = tuple(choices)
    if value not in choices:
        allowed = ", ".join(repr(c) if isinstance(c, str) else str(c) for c in choices)
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}")
    return value


def check_type(name: str, value: Any, types: type | tuple[type, ...], what: str | None = None) -> Any:
    """``value`` must be an instance of ``types``; ``what`` says it in words (``"an nn.Module"``)."""
    if not isinstance(value, types):
        if what is None:
            names = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
            what = f"a {names}"
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return value


def check_tensor(name: str, value: Any, *, ndim: int | None = None, dtypes: Iterable[torch.dtype] | None = None,
                 floating: bool = False) -> torch.Tensor:
    """``value`` must be a ``torch.Tensor`` with ``ndim`` dimensions and one of ``dtypes``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if value.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {value.dtype}")
    return value
