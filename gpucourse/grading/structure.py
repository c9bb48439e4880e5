"""Structure before values: does a kernel's value have the shape of the course's answer?

The judge walks every case's value against the course's own value for that case *before* any
compare function decides (``Judge.compare``): a compare that loops over ``zip(got, want)`` cannot
then pass an empty or truncated result. A value of another structure fails; the check's compare
then runs only to word it, where it has a better message than this module's (``rank 0 at step 0:
expected [(0, 0, 'diagonal')], got []`` rather than ``expected a list of 1 item, got 0 items``).
What counts as the same structure:

==========================  ====================================================================
the course's value (want)   a kernel's value (got) must be
==========================  ====================================================================
``list`` / ``tuple``        a list or a tuple (either) of as many items, each of the same structure
``dict``                    a dict with the same keys, each value of the same structure
``set`` / ``frozenset``     a set of as many elements
a tensor / an ndarray       a tensor (an ndarray) of the same shape and dtype
:class:`~.wire.Record`      a record of the same type, its fields of the same structure
:class:`~.wire.Opaque`      an opaque value of the same type
``float`` (``complex``)     a number: an int or a float (or a complex); never a bool
``int``                     an int, never a bool;  ``bool``: a bool
``None``, ``str``, …        a value of the same type
:class:`~.wire.Raised`      anything: what the course expects to be raised, the compare decides
==========================  ====================================================================

A :class:`~.wire.Raised` where a value was expected is a mismatch, named the way a learner
reads it (``rank 1 raised NameError: name 'x' is not defined``).

Example::

    >>> import torch
    >>> print(mismatch([[1, 2, 3, 4], []], [[5, 6, 7, 8], [5, 6, 7, 8]]))
    the result[1]: expected a list of 4 items, got 0 items
    >>> print(mismatch({"y": torch.zeros(2, 3)}, {"y": torch.ones(2, 4)}))
    the result['y']: expected a tensor of shape (2, 4), float32, got a tensor of shape (2, 3), float32
    >>> mismatch((1, 2, [True]), [3, 4.5, (False,)]) is None        # the same structure
    True
    >>> print(mismatch([1, 2.0], [3, 4]))                             # an int is expected: not a float
    the result[1]: expected an int, got a float
"""

from __future__ import annotations

import re
import sys

from .wire import Opaque, Raised, Record

__all__ = ["describe", "mismatch", "raised_text"]

_SEQUENCES = (list, tuple)
_RANK_LINE = re.compile(r"^ranks? [\d, ]+ raised ")
_BLOCKED = re.compile(r" Blocked: (.*?)\.(?= [A-Z]|$)")


def raised_text(r: Raised) -> str:
    """What a :class:`~.wire.Raised` tells a learner, on one line.

    Example::

        >>> message = "rank 1 raised NameError: name 'x' is not defined\\nTraceback ..."
        >>> raised_text(Raised("WorkerError", ("WorkerError", "RuntimeError"), message, "NameError"))
        "rank 1 raised NameError: name 'x' is not defined"
        >>> raised_text(Raised("ValueError", ("ValueError",), "bad size\\nmore"))
        'the code raised ValueError: bad size'
    """
    lines = [line.strip() for line in r.message.splitlines() if line.strip()]
    blocked = _BLOCKED.search(lines[0]) if lines and r.is_a("TimeoutError") else None
    if blocked:      # ranks that hung: where each one waited, and the check stopped there
        head = lines[0].split(". ", 1)[0]
        return (f"the code raised {r.type}: {head}. Blocked: {blocked[1][:700]}. The check stopped at this "
                "case (the ranks would hang again)")
    first = (lines[0][:500] + ("…" if len(lines[0]) > 500 else "")) if lines else ""
    if r.remote_type and _RANK_LINE.match(first):
        return first
    if r.remote_type:
        return f"a rank raised {r.remote_type}" + (f" ({r.type}: {first})" if first else f" ({r.type})")
    return f"the code raised {r.type}" + (f": {first}" if first else "")


def _dtype(v) -> str:
    return str(v.dtype).removeprefix("torch.")


def _tensor_types():
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    return (torch.Tensor if torch is not None else None), (np.ndarray if np is not None else None)


def describe(v) -> str:
    """A value's structure in a few words (``a list of 3 items``, ``a tensor of shape (2,), int64``).

    Example::

        >>> describe([1, 2]), describe({"b": 1, "a": 2}), describe(True), describe(None)
        ('a list of 2 items', "a dict with the keys ['a', 'b']", 'a bool', 'None')
    """
    tensor, ndarray = _tensor_types()
    if isinstance(v, Raised):
        return f"an exception ({raised_text(v)})"
    if v is None:
        return "None"
    if isinstance(v, bool):
        return "a bool"
    if isinstance(v, _SEQUENCES):
        return f"a {'list' if isinstance(v, list) else 'tuple'} of {len(v)} item{'' if len(v) == 1 else 's'}"
    if isinstance(v, dict):
        keys = sorted(map(repr, v))
        shown = ", ".join(keys[:8]) + (", …" if len(keys) > 8 else "")
        return f"a dict with the keys [{shown}]" if keys else "an empty dict"
    if isinstance(v, (set, frozenset)):
        return f"a set of {len(v)} element{'' if len(v) == 1 else 's'}"
    if tensor is not None and isinstance(v, tensor):
        return f"a tensor of shape {tuple(v.shape)}, {_dtype(v)}"
    if ndarray is not None and isinstance(v, ndarray):
        return f"an array of shape {tuple(v.shape)}, {v.dtype}"
    if isinstance(v, Record):
        return f"a {v.type}"
    if isinstance(v, Opaque):
        return f"a {v.type}"
    name = type(v).__name__
    return f"an {name}" if name[:1] in "aeiou" else f"a {name}"


def _same_kind(got, want) -> bool:
    """Is ``got`` the kind of value ``want`` is (containers not looked into)?"""
    tensor, ndarray = _tensor_types()
    if isinstance(want, bool):
        return isinstance(got, bool)
    if isinstance(want, int):
        return isinstance(got, int) and not isinstance(got, bool)
    if isinstance(want, float):
        return isinstance(got, (int, float)) and not isinstance(got, bool)
    if isinstance(want, complex):
        return isinstance(got, (int, float, complex)) and not isinstance(got, bool)
    if isinstance(want, _SEQUENCES):
        return isinstance(got, _SEQUENCES)
    if isinstance(want, dict):
        return isinstance(got, dict)
    if isinstance(want, (set, frozenset)):
        return isinstance(got, (set, frozenset))
    if tensor is not None and isinstance(want, tensor):
        return isinstance(got, tensor)
    if ndarray is not None and isinstance(want, ndarray):
        return isinstance(got, ndarray)
    if isinstance(want, (Record, Opaque)):
        return type(got) is type(want) and got.type == want.type
    return type(got) is type(want)


def mismatch(got, want, what: str = "the result", *, any_length=frozenset(), _path=()) -> str | None:
    """How ``got``'s structure differs from ``want``'s (the first difference found, named by its
    path: ``the result[1]['grads']``), or ``None`` when they have the same structure.

    ``any_length``: paths (tuples of indices and keys; ``()`` is the value itself) where a list may
    hold any number of items, each of the structure of ``want``'s first item — an exercise whose
    every right answer need not have the course's length.
    """
    if isinstance(want, Raised):
        return None                                      # what is raised: the compare decides
    if isinstance(got, Raised):
        return f"{what}: expected {describe(want)}, but {raised_text(got)}"
    if not _same_kind(got, want):
        return f"{what}: expected {describe(want)}, got {describe(got)}"
    tensor, ndarray = _tensor_types()
    if isinstance(want, _SEQUENCES):
        if _path in any_length:
            pairs = [(g, want[0]) for g in got] if want else []
        else:
            if len(got) != len(want):
                return f"{what}: expected {describe(want)}, got {len(got)} item{'' if len(got) == 1 else 's'}"
            pairs = zip(got, want, strict=True)
        for i, (g, w) in enumerate(pairs):
            problem = mismatch(g, w, f"{what}[{i}]", any_length=any_length, _path=(*_path, i))
            if problem:
                return problem
        return None
    if isinstance(want, dict):
        missing = [k for k in want if k not in got]
        extra = [k for k in got if k not in want]
        if missing or extra:
            return (f"{what}: expected a dict with the keys {sorted(map(repr, want))}; "
                    + ", ".join(filter(None, [
                        f"missing {sorted(map(repr, missing))}" if missing else "",
                        f"unexpected {sorted(map(repr, extra))[:8]}" if extra else ""])))
        for k, w in want.items():
            problem = mismatch(got[k], w, f"{what}[{k!r}]", any_length=any_length, _path=(*_path, k))
            if problem:
                return problem
        return None
    if isinstance(want, (set, frozenset)):
        return None if len(got) == len(want) else f"{what}: expected {describe(want)}, got {describe(got)}"
    if any(kind is not None and isinstance(want, kind) for kind in (tensor, ndarray)):
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            return f"{what}: expected {describe(want)}, got {describe(got)}"
        return None
    if isinstance(want, Record):
        return mismatch(got.fields, want.fields, f"{what} ({want.type})", any_length=any_length,
                        _path=(*_path, "fields"))
    return None
