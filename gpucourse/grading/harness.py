"""What a check cell does: run *your* code on the grader's inputs, and let the grader decide.

A check cell ends with one call::

    # Check 08.1 — model_state_bytes for random sizes, ranks and stages
    def cases(rng):                                  # the inputs (drawn by the grader, never here)
        for _ in range(300):
            yield rng.randint(1, 10**6), rng.choice([1, 2, 4, 8]), rng.randint(0, 3)

    gc.check_exercise("08.1", model_state_bytes, cases)

and the verdict is never computed in the process that runs your code::

    judge (its own process: the course's solutions, never your code)
      1) cases(rng) with the grader's seed ──────────────► inputs, as data (``wire``)
                                                   kernel: 2) run(*case) with YOUR function
      4) run(*case) with the course's answer  ◄────────── 3) the values, as data
      5) compare(case, got, want): passed, or which case failed, expected, got, a hint

Where the judge lives depends on who asked:

- **local** (you run the cell in JupyterLab): a judge process started by this kernel on the first
  check (it reads the course's ``solutions/``) prints ``08.1 passed ✓`` or raises
  :class:`CheckFailed` with the reason. Where ``solutions/`` is absent (an instructor kept it), the
  judge is a *public* one (:mod:`.public`): the same checks on the public cases shipped in
  ``exercises/public/`` (fixed inputs, the course's values for them), and the cell says so —
  ``08.1 passed ✓ on the public cases — your instructor's grader draws new ones``;
- **graded** (``python -m gpucourse check/grade``): the grader primes each check cell with its
  inputs and collects the values afterwards; its own judge decides, after the notebook ran. Your
  kernel never sees the expected values, the hidden checks or the solutions;
- **judge**: inside the judge, the same call only *registers* the check (cases, run, compare).

Everything the kernel reports is a *claim* about your code's values; only the right values pass.

.. warning::
   ``forbid=["gc.zero_memory"]`` makes those functions raise :class:`ForbiddenCall` when your code
   calls them during the check (directly, through an alias, on any rank): an exercise that asks you
   to build something does not pass by calling the course's own version.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import wire
from .wire import Opaque, Raised, Record

__all__ = ["CaseRNG", "CheckFailed", "ForbiddenCall", "Spec", "check_exercise", "check_hidden",
           "collect", "describe_call", "expect", "expect_close", "expect_equal", "install_graded",
           "prime", "run_hidden", "same", "set_check_seed"]


class CheckFailed(AssertionError):
    """A check's verdict: your code's values differ from the course's answer (the message says how)."""


class ForbiddenCall(RuntimeError):
    """Your code called a function that this exercise asks you to write yourself."""


# --- the inputs: a random source the judge seeds -----------------------------------------------

class CaseRNG(random.Random):
    """``random.Random`` plus tensors, seeded by the grader: what ``cases(rng)`` draws from.

    Example::

        >>> rng = CaseRNG(7)
        >>> a, b = rng.randint(0, 9), rng.randn(2, 3)
        >>> tuple(b.shape), CaseRNG(7).randint(0, 9) == a
        ((2, 3), True)
    """

    def __init__(self, seed: int):
        super().__init__(seed)
        self._torch_seed = seed & ((1 << 63) - 1)
        self._generator = None

    @property
    def generator(self):
        """A ``torch.Generator`` seeded from the same seed (for ``torch.randn(..., generator=)``)."""
        if self._generator is None:
            import torch

            self._generator = torch.Generator().manual_seed(self._torch_seed)
        return self._generator

    def randn(self, *shape, dtype=None):
        import torch

        return torch.randn(*shape, generator=self.generator, dtype=dtype or torch.float32)

    def rand(self, *shape, dtype=None):
        import torch

        return torch.rand(*shape, generator=self.generator, dtype=dtype or torch.float32)

    def integers(self, low: int, high: int, *shape):
        """A tensor of ints in ``[low, high)`` (int64)."""
        import torch

        return torch.randint(low, high, shape, generator=self.generator)

    def seed31(self) -> int:
        """A fresh seed for ``torch.manual_seed`` inside a run."""
        return self.randrange(1 << 31)


def case_seed(seed: int, slot: str) -> int:
    """The seed of one check's inputs: the grader's run seed and the slot, hashed (stable)."""
    digest = hashlib.sha256(f"{seed}/{slot}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


# --- judging: the default comparison and the vocabulary of compare functions --------------------

def expect(condition, message: str) -> None:
    """In a ``compare`` function: fail the case with ``message`` unless ``condition`` holds."""
    if not condition:
        raise CheckFailed(message)


def _short(v, limit: int = 120) -> str:
    """A value as a message shows it: small tensors in full, large ones by shape — inside
    containers too.

    Example::

        >>> import torch
        >>> _short((torch.zeros(7, 2), torch.ones(2, dtype=torch.int64), [1.5, "a"]))
        "(tensor of shape (7, 2), float32, tensor([1, 1], int64), [1.5, 'a'])"
    """
    if isinstance(v, Raised):
        return f"raised {v}"
    if isinstance(v, Opaque):
        return f"a {v.type} ({v.repr[:60]})"
    if isinstance(v, Record):
        return f"a {v.type}"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        dtype = str(v.dtype).removeprefix("torch.")
        if v.numel() <= 8:
            vals = v.tolist()
            return f"tensor({vals}, {dtype})"
        return f"tensor of shape {tuple(v.shape)}, {dtype}"
    if isinstance(v, (list, tuple)) and type(v) in (list, tuple):
        inner = ", ".join(_short(x, limit) for x in v[:limit // 4])
        inner += ", …" if len(v) > limit // 4 else ""
        text = f"[{inner}]" if isinstance(v, list) else f"({inner}{',' if len(v) == 1 else ''})"
    elif isinstance(v, dict) and type(v) is dict:
        text = "{" + ", ".join(f"{k!r}: {_short(x, limit)}" for k, x in list(v.items())[:limit // 4]) + "}"
    else:
        text = repr(v)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _kind(v) -> str:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        return "tensor"
    if isinstance(v, bool):
        return "bool"
    return type(v).__name__


def same(got, want, *, rtol: float | None = None, atol: float | None = None, exact: bool = False,
         what: str = "the result") -> None:
    """Raise :class:`CheckFailed` unless ``got`` matches ``want`` — the default comparison.

    Types count (an ``int`` where an ``int`` is expected; a ``float`` may be expected as close),
    containers are compared item by item, tensors by shape, dtype and value (``exact`` or within
    ``rtol``/``atol``, torch's defaults per dtype), exceptions by class (a subclass counts).

    Example::

        >>> same([1, 2.0000000001], [1, 2.0])
        >>> try:
        ...     same({"a": (1, 2)}, {"a": (1, 3)})
        ... except CheckFailed as e:
        ...     print(e)
        the result['a'][1]: expected 3, got 2
    """
    if isinstance(got, Raised) and not isinstance(want, Raised):
        if got.not_implemented:
            raise CheckFailed(f"not implemented yet: {got}")
        raise CheckFailed(f"{what}: expected {_short(want)}, but the code raised {got}")
    if isinstance(want, Raised):
        if isinstance(got, Raised):
            expect(got.is_a(want.type), f"{what}: expected {want.type} to be raised, got {got}")
            return
        raise CheckFailed(f"{what}: expected {want.type} to be raised, got {_short(got)}")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(want, torch.Tensor):
        expect_close(got, want, what, rtol=rtol, atol=atol, exact=exact)
        return
    if want is None or isinstance(want, (bool, str, bytes)):
        expect(type(got) is type(want) and got == want, f"{what}: expected {_short(want)}, got {_short(got)}")
        return
    if isinstance(want, int):
        expect(isinstance(got, int) and not isinstance(got, bool),
               f"{what}: expected the int {want}, got {_short(got)} (a {_kind(got)})")
        expect(got == want, f"{what}: expected {want}, got {got}")
        return
    if isinstance(want, (float, complex)):
        ok_type = isinstance(got, (int, float, complex)) and not isinstance(got, bool)
        expect(ok_type, f"{what}: expected the number {_short(want)}, got {_short(got)} (a {_kind(got)})")
        if exact:
            expect(got == want or (got != got and want != want)
                   or _within_rounding_across_machines(got, want), f"{what}: expected {want!r}, got {got!r}")
            return
        r = 1e-7 if rtol is None else rtol
        a = 1e-12 if atol is None else atol
        both_nan = isinstance(got, float) and math.isnan(got) and isinstance(want, float) and math.isnan(want)
        expect(both_nan or abs(got - want) <= a + r * abs(want)
               or _within_rounding_across_machines(got, want), f"{what}: expected {want!r}, got {got!r}")
        return
    if isinstance(want, (list, tuple)):
        expect(isinstance(got, (list, tuple)), f"{what}: expected a {type(want).__name__} of {len(want)}, "
                                               f"got {_short(got)}")
        expect(len(got) == len(want), f"{what}: expected {len(want)} items, got {len(got)}: {_short(got)}")
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, rtol=rtol, atol=atol, exact=exact, what=f"{what}[{i}]")
        return
    if isinstance(want, dict):
        expect(isinstance(got, dict), f"{what}: expected a dict, got {_short(got)}")
        missing, extra = [k for k in want if k not in got], [k for k in got if k not in want]
        expect(not missing and not extra, f"{what}: keys differ — missing {missing}, unexpected {extra}")
        for k in want:
            same(got[k], want[k], rtol=rtol, atol=atol, exact=exact, what=f"{what}[{k!r}]")
        return
    if isinstance(want, (set, frozenset)):
        expect(isinstance(got, (set, frozenset)) and set(got) == set(want),
               f"{what}: expected {_short(want)}, got {_short(got)}")
        return
    if isinstance(want, Record):
        expect(isinstance(got, Record) and got.type == want.type,
               f"{what}: expected a {want.type}, got {_short(got)}")
        same(got.fields, want.fields, rtol=rtol, atol=atol, exact=exact, what=f"{what} ({want.type})")
        return
    if isinstance(want, Opaque):
        expect(isinstance(got, Opaque) and got.type == want.type, f"{what}: expected a {want.type}, got {_short(got)}")
        return
    expect(got == want, f"{what}: expected {_short(want)}, got {_short(got)}")


def expect_equal(got, want, what: str = "the result") -> None:
    """In a ``compare`` function: ``got`` must equal ``want`` exactly (tensors bit for bit)."""
    same(got, want, exact=True, what=what)


def expect_close(got, want, what: str = "the result", *, rtol: float | None = None,
                 atol: float | None = None, exact: bool = False) -> None:
    """In a ``compare`` function: ``got`` must be a tensor of ``want``'s shape and dtype, close to it.

    Where ``want`` was computed on another machine (the public cases, see
    :func:`values_from_another_machine`), floating-point values that miss the tolerance (or ``exact``)
    still pass within that machine's rounding: :data:`ACROSS_MACHINES_ULPS` of the dtype's eps of the
    tensor's largest magnitude.
    """
    import torch

    if isinstance(got, Raised):
        same(got, want, what=what)
    expect(isinstance(got, torch.Tensor), f"{what}: expected a tensor of shape {tuple(want.shape)}, "
                                          f"got {_short(got)}")
    expect(tuple(got.shape) == tuple(want.shape),
           f"{what}: expected shape {tuple(want.shape)}, got {tuple(got.shape)}")
    expect(got.dtype == want.dtype, f"{what}: expected dtype {want.dtype}, got {got.dtype}")
    if exact:
        ok = torch.equal(got, want) or (got.is_floating_point() and bool(
            ((got == want) | (got.isnan() & want.isnan())).all()))
        if not ok and not _within_rounding_across_machines(got, want):
            raise CheckFailed(f"{what}: not bit-for-bit equal: {_mismatch(got, want, 0.0, 0.0)}"
                              f"{_elsewhere_note(want)}")
        return
    tolerance = {} if rtol is None and atol is None else {"rtol": rtol or 0.0, "atol": atol or 0.0}
    try:
        torch.testing.assert_close(got, want, equal_nan=True, **tolerance)
    except AssertionError:
        if _within_rounding_across_machines(got, want):
            return
        r, a = (tolerance["rtol"], tolerance["atol"]) if tolerance else _DEFAULT_TOLERANCE.get(
            str(want.dtype).removeprefix("torch."), (0.0, 0.0))
        raise CheckFailed(f"{what}: values differ: {_mismatch(got, want, r, a)}{_elsewhere_note(want)}") from None


#: torch.testing.assert_close's tolerances (rtol, atol) per dtype, which a check without its own uses
_DEFAULT_TOLERANCE = {"float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5), "float32": (1.3e-6, 1e-5),
                      "float64": (1e-7, 1e-7), "complex64": (1.3e-6, 1e-5), "complex128": (1e-7, 1e-7)}

#: Where the course's values come from another machine — the public cases in ``exercises/public/``,
#: computed once by ``make exercises`` — a float result of the learner's kernel differs from them by
#: rounding alone: another CPU's matrix and reduction kernels add in another order, and an element
#: that is a difference of near-equal sums differs by far more than its own eps (measured between the
#: machine that made the files and an AMD EPYC: 06.2's unscaled gradients up to 1.3e-4 apart
#: relatively, elementwise, but 2.9e-7 of the tensor's largest magnitude; 10.2's parameters after
#: 20 SGD steps 6.0e-8 apart, bit-identical on one machine). So there a comparison that fails is
#: tried again with each element allowed this many eps of its dtype (float32 and wider; 2 for 16-bit
#: and 8-bit floats, whose own rounding dwarfs the order of the adds) times the tensor's largest
#: finite magnitude (a Python float: this many float32 eps of its own size); NaNs and infinities
#: must sit where the course's do. The instructor's grader computes the course's values on the
#: machine that runs the notebook and compares as written.
ACROSS_MACHINES_ULPS = 64
_across_machines = contextvars.ContextVar("gpucourse_values_from_another_machine", default=False)


@contextlib.contextmanager
def values_from_another_machine(on: bool = True):
    """Within it, :func:`expect_close` and :func:`expect_equal` allow for another machine's rounding
    (:data:`ACROSS_MACHINES_ULPS`): the public judge compares under it. ``on=False``: as written."""
    token = _across_machines.set(bool(on))
    try:
        yield
    finally:
        _across_machines.reset(token)


def _within_rounding_across_machines(got, want) -> bool:
    """Whether float tensors (or Python floats) ``got`` and ``want`` differ by another machine's
    rounding alone — only inside :func:`values_from_another_machine`; False elsewhere. A Python
    float may be off by :data:`ACROSS_MACHINES_ULPS` float32 eps of its own size.

        >>> import torch
        >>> want = torch.tensor([1.0, -1e-3, float("inf"), float("nan")])
        >>> drift = want + torch.tensor([0.0, 2e-7, 0.0, 0.0])          # 2e-7: 1.7 eps of the largest, 1.0
        >>> _within_rounding_across_machines(drift, want)
        False
        >>> with values_from_another_machine():
        ...     (_within_rounding_across_machines(drift, want),
        ...      _within_rounding_across_machines(want + torch.tensor([0.0, 1e-4, 0.0, 0.0]), want),
        ...      _within_rounding_across_machines(torch.tensor([1.0, -1e-3, -math.inf, math.nan]), want))
        (True, False, False)
        >>> with values_from_another_machine():
        ...     (_within_rounding_across_machines(0.1 + 1e-9, 0.1),
        ...      _within_rounding_across_machines(0.1001, 0.1))
        (True, False)
    """
    if not _across_machines.get():
        return False
    if isinstance(want, float):     # a Python float: most come from a float32 tensor (.item(), a loss)
        return isinstance(got, (int, float)) and not isinstance(got, bool) and math.isfinite(want) \
            and math.isfinite(got) and abs(got - want) <= ACROSS_MACHINES_ULPS * 2.0 ** -23 * abs(want)
    import torch

    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) \
            or not want.is_floating_point() or got.dtype != want.dtype or got.shape != want.shape:
        return False
    g, w = got.detach().double(), want.detach().double()
    finite = w.isfinite()
    if not torch.equal(g.isnan(), w.isnan()) or not torch.equal(g.isfinite(), finite) \
            or not torch.equal(g[w.isinf()], w[w.isinf()]):
        return False
    if not bool(finite.any()):
        return True
    return bool(((g[finite] - w[finite]).abs() <= _across_machines_allowance(want)).all())


def _across_machines_allowance(want) -> float:
    """How far an element of the float tensor ``want`` may be off where it was computed on another
    machine: :data:`ACROSS_MACHINES_ULPS` eps of its dtype (2 for 16-bit and 8-bit floats) of its
    largest finite magnitude."""
    import torch

    info = torch.finfo(want.dtype)
    finite = want.detach().double()[want.isfinite()]
    largest = float(finite.abs().max()) if finite.numel() else 0.0
    return (ACROSS_MACHINES_ULPS if info.bits >= 32 else 2) * info.eps * largest


def _elsewhere_note(want) -> str:
    """What a failure adds where the course's values came from another machine (the public cases)."""
    if not _across_machines.get() or not want.is_floating_point():
        return ""
    return (f"; beyond another machine's rounding too (the public values were computed elsewhere: up "
            f"to {_across_machines_allowance(want):.2g} off was allowed)")


def _digits(dtype) -> int:
    """Significant digits that tell two neighbouring values of ``dtype`` apart (float32: 9)."""
    name = str(dtype).removeprefix("torch.")
    digits = {"float64": 17, "complex128": 17, "float32": 9, "complex64": 9}
    return digits.get(name, 5 if "float" in name else 17)


def _mismatch(got, want, rtol: float = 0.0, atol: float = 0.0) -> str:
    """Which elements miss ``atol + rtol * |want|`` (all that differ, when both are 0), and the worst:
    its index, both values to as many digits as tell them apart, the difference and what was allowed.

        >>> import torch
        >>> got, want = torch.tensor([1.0, 2.0, -0.18685603]), torch.tensor([1.0, 2.0000002, -0.18685628])
        >>> _mismatch(got, want, rtol=1e-6).split("; ")  # doctest: +NORMALIZE_WHITESPACE
        ['1 of 3 elements differ beyond the tolerance',
         'the largest at index (2,): expected -0.186856285, got -0.186856031 (difference 2.5e-07, allowed 1.9e-07)']
        >>> _mismatch(torch.tensor([math.inf, 1.0, math.nan]), torch.tensor([math.inf, 2.0, math.nan]))
        '1 of 3 elements differ; the largest at index (1,): expected 2, got 1'
    """
    import torch

    g, w = got.detach().double().reshape(-1), want.detach().double().reshape(-1)
    diff = (g - w).abs().nan_to_num(math.inf)          # one NaN: infinitely far; equal infinities: 0
    diff = torch.where((g == w) | (g.isnan() & w.isnan()), torch.zeros_like(diff), diff)
    allowed = atol + rtol * w.abs().nan_to_num(0.0, 0.0, 0.0)
    over = torch.where(diff > allowed, diff - allowed, torch.zeros_like(diff))
    worst = over if bool((over > 0).any()) else diff
    i = int(worst.argmax())
    idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), tuple(want.shape))) if want.dim() else ()
    bad = int((diff > allowed).sum())
    d = _digits(want.dtype)
    text = (f"{bad} of {want.numel()} elements differ{' beyond the tolerance' if rtol or atol else ''}; "
            f"the largest at index {idx}: expected {w[i].item():.{d}g}, got {g[i].item():.{d}g}")
    if rtol or atol:
        text += f" (difference {diff[i].item():.2g}, allowed {allowed[i].item():.2g})"
    return text


def describe_call(name: str, case) -> str:
    """``model_state_bytes(1000, 3, 2)``: how a message names one case."""
    if isinstance(case, tuple):
        args = ", ".join(_short(a, 60) for a in case)
    elif isinstance(case, dict):
        args = ", ".join(f"{k}={_short(v, 60)}" for k, v in case.items())
    else:
        args = _short(case, 60)
    return f"{name}({args})"


# --- the registry of checks (judge side) --------------------------------------------------------

@dataclass
class Spec:
    """One check as the judge holds it."""

    slot: str                               # "08.1" or "08.1/hidden"
    exercise: str
    kind: str                               # "visible" / "hidden"
    cases: Callable
    run: Callable | None = None
    compare: Callable | None = None
    rtol: float | None = None
    atol: float | None = None
    exact: bool = False
    forbid: tuple = ()
    hint: str = ""
    describe: Callable | None = None
    title: str = ""
    max_slowdown: float | None = None       # hidden checks: timed by the grader (see check_hidden)


#: a timed hidden check (``max_slowdown=``) may always take this long, however fast the course's
#: answer ran: below it, a loaded machine's noise, not the learner's code, would decide
TIMED_FLOOR_SECONDS = 3.0


def time_limit(max_slowdown: float, course_seconds: float) -> float:
    """The longest a timed hidden check's cases may take: ``max_slowdown`` times the course's answer
    on the same inputs, and never less than :data:`TIMED_FLOOR_SECONDS`.

        >>> time_limit(5, 0.1), time_limit(5, 1.0)
        (3.0, 5.0)
    """
    return max(TIMED_FLOOR_SECONDS, max_slowdown * course_seconds)


#: the judge fills this while it executes a solutions notebook (mode "judge")
SPECS: dict[str, Spec] = {}
_state: dict[str, Any] = {"mode": "local", "primed": None, "collected": None, "runs": {},
                          "judge": None, "seed": None, "title": ""}


def _mode() -> str:
    return _state["mode"]


def set_check_seed(seed: int | None) -> None:
    """Draw the inputs of the next local checks from ``seed`` (a failure message names its seed)."""
    _state["seed"] = None if seed is None else int(seed)


# --- running a check's cases (kernel side, and the judge's reference) --------------------------

def _call(run: Callable, case):
    if isinstance(case, tuple):
        return run(*case)
    if isinstance(case, dict):
        return run(**case)
    return run(case)


def _seed_everything(seed: int, cpu_only: bool) -> None:
    """Seed ``random``, numpy and torch; ``cpu_only``: :func:`_only_the_cpu_can_start`, asked once
    per check (``torch.cuda.device_count()`` tries NVML on every call)."""
    random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        if cpu_only:
            torch.default_generator.manual_seed(seed)
        else:
            torch.manual_seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)


def _only_the_cpu_can_start(torch) -> bool:
    """Would ``torch.manual_seed`` seed nothing but the CPU's generator in this process?

    Then a check seeds that generator alone, for every case. Before CUDA, XPU and MTIA start,
    ``torch.manual_seed`` queues their seeding for when they do, and records its caller's stack
    for each with ``traceback.format_stack()``: three walks over every frame, each asking
    ``linecache`` about every frame's source file. That took 0.4 ms a call 40 frames down (about a
    kernel's depth) and 3-4 ms 120 frames down (a test run; py-spy found half of the pytest workers'
    own time in the mutation tests there, 2026-12-07). Here none of them can start — no CUDA device
    (``torch.cuda.device_count()``, which asks NVML first and so leaves CUDA uninitialised where a
    driver is installed), no XPU or MTIA build, no MPS, no custom device — so those queued seeds
    would never be applied. Wherever one could start, or already has, ``torch.manual_seed`` seeds
    as ever.

        >>> import torch
        >>> _only_the_cpu_can_start(torch) == (torch.cuda.device_count() == 0
        ...                                    and not torch.backends.mps.is_available())
        True
    """
    try:
        return (torch.cuda.device_count() == 0 and not torch.xpu._is_compiled()
                and not torch.mtia._is_compiled() and not torch.backends.mps.is_available()
                and not hasattr(torch, torch._C._get_privateuse1_backend_name()))
    except Exception:   # noqa: BLE001 - a torch without one of these: seed as torch does
        return False


#: torch functions whose float32 and float64 kernels call MKL's vector math (VML) on x86, see
#: :func:`_warm_vector_math`: the 16 VML functions libtorch_cpu exports (vmsTanh, vmdLn, …), each seen
#: called by its torch function under gdb (torch 2.14.1); log1p, lgamma and sigmoid call none
_VML_FUNCTIONS = ("acos", "asin", "atan", "cos", "sin", "tan", "tanh", "erf", "erfc", "erfinv", "exp", "log",
                  "log10", "log2", "sqrt", "trunc")
_vml_warm = False


def _warm_vector_math() -> None:
    """Call each of torch's VML-backed functions once, in this thread, before any case runs.

    MKL picks a VML function's code on its first call in a process. Threads that make that first
    call together can get a less accurate variant: in a fresh process, 4 threads' first
    ``torch.tanh(nn.Linear(…)(x))`` (02.4's case; tanh is MKL's ``vmsTanh``) differed from the same
    calls made serially in 2 to 10 of 100 fresh processes (one tanh 3.8e-5 from float64's, where the
    serial one is within 5e-8). A check that runs the learner's threads then failed an honest
    answer, in the kernel or in the judge (each a process of its own). With one call of each function
    here first, 0 of 300 (in the same runs, 5 of 300 without it).
    """
    global _vml_warm
    torch = sys.modules.get("torch")
    if _vml_warm or torch is None:
        return
    _vml_warm = True
    for dtype in (torch.float32, torch.float64):
        x = torch.linspace(0.1, 0.9, 40, dtype=dtype)
        with torch.no_grad():
            for name in _VML_FUNCTIONS:
                getattr(torch, name)(x)


def run_cases(run: Callable, cases: list, seeds: list[int]) -> list:
    """Each case's value (or :class:`~.wire.Raised`), encoded as it comes (a later change to a
    returned tensor cannot alter it). Stops at the first ``NotImplementedError``, and at the first
    case whose ranks stayed blocked (a ``gc.RankTimeout`` or ``gc.launch``'s ``TimeoutError``):
    a deadlock costs one case's timeout, not every case's."""
    from ..runtime import hide_check_frames    # here: the grader's own process never imports torch
    live = sys.modules.get("gpucourse.runtime.live_ranks")     # loaded wherever live ranks run
    checking = live.checking if live is not None else contextlib.nullcontext
    _warm_vector_math()
    torch = sys.modules.get("torch")
    cpu_only = torch is not None and _only_the_cpu_can_start(torch)
    nodes = []
    for case, seed in zip(cases, seeds):
        _seed_everything(seed, cpu_only)
        blocked = False
        try:
            with checking(), hide_check_frames(run):
                value = _call(run, case)
        except Exception as e:  # noqa: BLE001 - every failure of the code under test is a value
            value = wire.raised(e)
            blocked = isinstance(e, TimeoutError) and getattr(e, "blocked", None) is not None
        except KeyboardInterrupt:
            raise
        try:
            nodes.append(wire.encode(value))
        except wire.WireError as e:
            nodes.append(wire.encode(Raised("WireError", ("WireError",), str(e))))
        if isinstance(value, Raised) and value.not_implemented:
            break
        if blocked:         # ranks that hung once hang again: the case's timeout once is enough
            break
    return nodes


# --- forbidden helpers: they raise when the code under test calls them ---------------------------

_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])
_RUNTIME_DIR = os.path.join(_PACKAGE_DIR, "runtime")


def _resolve(dotted: str):
    root, *chain = dotted.split(".")
    import importlib

    obj = importlib.import_module({"gc": "gpucourse", "dist": "torch.distributed",
                                   "F": "torch.nn.functional"}.get(root, root))
    for attr in chain:
        obj = getattr(obj, attr)
    return obj


_LIBRARY_DIRS = tuple(sorted({os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)
                               if p}))


def _called_by_the_course(frame) -> bool:
    """Who called a forbidden function? Walk up past library frames (torch's ``Module.__call__``,
    the standard library, the launcher) to the first frame that is either the course's package (it
    may use its own helpers) or the learner's code (it may not)."""
    while frame is not None:
        path = frame.f_code.co_filename
        real = os.path.realpath(path) if not path.startswith("<") else path
        if real.startswith(_PACKAGE_DIR + os.sep) and not real.startswith(_RUNTIME_DIR + os.sep):
            return True
        library = path.startswith("<frozen") or real.startswith(_LIBRARY_DIRS) or real.startswith(
            _RUNTIME_DIR + os.sep)
        if not library:
            return False
        frame = frame.f_back
    return True


def _gate(key: str, args, kwargs):
    """Called instead of a forbidden function: the course's own code may still use it."""
    original, name = _FORBIDDEN[key]
    if _called_by_the_course(sys._getframe(2)):
        return original(*args, **kwargs)
    raise ForbiddenCall(f"{name} is off limits in exercise {_state.get('exercise', '?')}: the exercise "
                        f"asks you to write it yourself")


_FORBIDDEN: dict[str, tuple] = {}


def _gate_code(name: str, key: str, free) -> types.CodeType:
    """The code a forbidden function runs instead of its own: a call to :func:`_gate`.

    A function with a closure — a method that calls ``super()`` has one, ``__class__``; a decorated
    function has its decorator's — only takes code with as many free variables, so the gate then
    declares that many (``free``: their count, or their names; it never reads them).

    Example::

        >>> class A:
        ...     def f(self):
        ...         return "A"
        >>> class B(A):
        ...     def f(self):
        ...         return "B" + super().f()
        >>> B.f.__code__ = _gate_code("f", "k", len(B.f.__code__.co_freevars))   # accepted
        >>> _gate_code("g", "k", 2).co_freevars
        ('_free0', '_free1')
        >>> _gate_code("__init__", "m.C.__init__", ("__class__",)).co_freevars
        ('__class__',)
    """
    call = (f"return __import__('gpucourse.grading.harness', fromlist=['_gate'])._gate({key!r}, args, kwargs)")
    if not free:
        return compile(f"def {name}(*args, **kwargs):\n    {call}\n", "<forbidden>", "exec").co_consts[0]
    names = list(free) if isinstance(free, (tuple, list)) else [f"_free{i}" for i in range(free)]
    src = ("def _outer():\n" + "".join(f"    {n} = None\n" for n in names)
           + f"    def {name}(*args, **kwargs):\n        if False:\n            ({', '.join(names)},)\n"
           + f"        {call}\n    return {name}\n")
    outer = compile(src, "<forbidden>", "exec").co_consts[0]
    return next(c for c in outer.co_consts if isinstance(c, types.CodeType))


def _functions_of(obj) -> list:
    """The Python functions behind a forbidden name: a function, or every method a class defines."""
    if isinstance(obj, type):
        members = list(obj.__dict__.values())
    else:
        members = [obj]
    functions = [getattr(m, "__func__", m) for m in members]
    return [f for f in functions if isinstance(f, types.FunctionType)]


@contextlib.contextmanager
def forbidden(names, exercise: str = ""):
    """While inside: each function in ``names`` (``"gc.zero_memory"``) raises :class:`ForbiddenCall`
    when called from outside the package — through any name bound to it, on forked ranks too. A
    class (``"gc.BalancedDataParallel"``) forbids every method it defines, ``super()`` users included.

    Example::

        >>> import gpucourse as gc, torch
        >>> dp = gc.DataParallel(torch.nn.Linear(2, 2), device_ids=["cpu:0", "cpu:1"])
        >>> with forbidden(["gc.BalancedDataParallel"], "03.3"):
        ...     try:
        ...         gc.BalancedDataParallel.scatter(dp, (torch.zeros(4, 2),), {}, dp.device_ids)
        ...     except ForbiddenCall as e:
        ...         print(e)
        gc.BalancedDataParallel is off limits in exercise 03.3: the exercise asks you to write it yourself
        >>> len(gc.BalancedDataParallel(1, torch.nn.Linear(2, 2), ["cpu:0", "cpu:1"]).scatter(
        ...     (torch.zeros(4, 2),), {}, ["cpu:0", "cpu:1"])[0])            # outside: as before
        2
    """
    swapped = []
    _state["exercise"] = exercise
    try:
        targets = []
        for dotted in names:
            try:
                targets += [(fn, dotted) for fn in _functions_of(_resolve(dotted))]
            except (ImportError, AttributeError):
                continue
        for fn, dotted in dict((id(fn), (fn, dotted)) for fn, dotted in reversed(targets)).values():
            key = f"{fn.__module__}.{fn.__qualname__}"
            copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                      fn.__closure__)
            copy.__kwdefaults__ = fn.__kwdefaults__
            _FORBIDDEN[key] = (copy, dotted)
            gate = _gate_code(fn.__name__, key, len(fn.__code__.co_freevars))
            swapped.append((fn, fn.__code__, fn.__defaults__, fn.__kwdefaults__))
            fn.__code__, fn.__defaults__, fn.__kwdefaults__ = gate, None, None
        yield
    finally:
        for fn, code, defaults, kwdefaults in reversed(swapped):
            fn.__code__, fn.__defaults__, fn.__kwdefaults__ = code, defaults, kwdefaults


# --- the check cell's call ------------------------------------------------------------------------

def check_exercise(exercise: str, run: Callable, cases: Callable, *, compare: Callable | None = None,
                   rtol: float | None = None, atol: float | None = None, exact: bool = False,
                   forbid=(), hint: str = "", describe: Callable | None = None) -> None:
    """Check exercise ``exercise``: ``run(*case)`` for every case of ``cases(rng)``, judged elsewhere.

    Args:
        exercise: its id, ``"08.1"``.
        run: what to call for one case — the learner's function itself, or a small function of the
            check cell that calls it (on ranks, with a model, …) and returns what to compare.
            A case that is a tuple is passed as ``run(*case)``, a dict as ``run(**case)``.
        cases: ``cases(rng)`` yields the inputs, drawn from ``rng`` (a :class:`CaseRNG`); runs in the
            judge only.
        compare: ``compare(case, got, want)`` (judge only) raises :class:`CheckFailed` (via
            :func:`expect`, :func:`expect_close`, ...) or ``AssertionError`` when ``got`` is wrong;
            default: :func:`same` with ``rtol``/``atol``/``exact``.
        forbid: functions the learner's code must not call here (``["gc.zero_memory"]``).
        hint: shown after a failure: what to look at.
        describe: ``describe(case)`` names a case in messages (default: ``run(args…)``).
    """
    __tracebackhide__ = True  # noqa: F841 - IPython shows the learner's frames, not the harness's
    if not callable(run):
        raise TypeError(f"check_exercise({exercise!r}, run, cases): run must be callable, got {run!r}")
    mode = _mode()
    if mode == "judge":
        SPECS[exercise] = Spec(exercise, exercise, "visible", cases, run, compare, rtol, atol, exact,
                               tuple(forbid), hint, describe, _state.get("title", ""))
        return
    _state["runs"][exercise] = run
    if mode == "graded":
        _graded_run(exercise, run)
        return
    _local_run(exercise, exercise, run, hidden=False)


def check_hidden(exercise: str, cases: Callable, *, compare: Callable | None = None,
                 rtol: float | None = None, atol: float | None = None, exact: bool | None = None,
                 hint: str | None = None, describe: Callable | None = None,
                 max_slowdown: float | None = None) -> None:
    """A hidden check (``solutions/`` only): more cases for the visible check's ``run``.

    The options default to the visible check's. In a graded run the grader inserts its own cell
    that runs these cases; the hidden check's source never reaches the learner's kernel.

    ``max_slowdown``: the hidden cases are also *timed*, from outside the learner's kernel (the
    grader's clock around the cell it inserted; a learner's own hidden check times them in the
    kernel). They fail when they take longer than :func:`time_limit`: ``max_slowdown`` times the
    course's answer on the same inputs, timed by the judge, and at least
    :data:`TIMED_FLOOR_SECONDS`. Only for what a kernel cannot hide from the clock: an answer
    orders of magnitude slower than the course's (01.1: a Python loop over a million rows), never a
    speed a machine's load could decide.
    """
    __tracebackhide__ = True  # noqa: F841 - IPython shows the learner's frames, not the harness's
    mode = _mode()
    slot = f"{exercise}/hidden"
    if max_slowdown is not None and not (isinstance(max_slowdown, (int, float)) and math.isfinite(max_slowdown)
                                         and max_slowdown >= 2):
        raise ValueError(f"check_hidden({exercise!r}, …, max_slowdown={max_slowdown!r}): a number ≥ 2 "
                         "(how many times the course's answer's time the hidden cases may take)")
    if mode == "judge":
        visible = SPECS.get(exercise)
        if visible is None:
            raise RuntimeError(f"hidden check of {exercise} before its visible check")
        SPECS[slot] = Spec(slot, exercise, "hidden", cases, visible.run,
                           compare if compare is not None else visible.compare,
                           visible.rtol if rtol is None else rtol, visible.atol if atol is None else atol,
                           visible.exact if exact is None else exact, visible.forbid,
                           visible.hint if hint is None else hint, describe or visible.describe,
                           _state.get("title", ""), max_slowdown)
        return
    if mode == "graded":
        print(f"(graded run: the grader runs the hidden checks of {exercise} itself)")
        return
    run = _state["runs"].get(exercise)
    if run is None:
        raise RuntimeError(f"run the check of {exercise} first: its hidden check uses the same code")
    _local_run(exercise, slot, run, hidden=True)


# --- graded mode (kernel side): primed by the engine, collected by the engine --------------------

def install_graded(output_limit: int) -> None:
    """The engine's first request in a fresh kernel: graded mode, output capped per cell, and no cell
    left without an answer (:func:`_answer_every_cell`)."""
    from IPython import get_ipython

    _state["mode"] = "graded"
    shell = get_ipython()
    _answer_every_cell(shell)
    if output_limit > 0:
        _cap_output(shell, output_limit)


def _answer_every_cell(shell) -> None:
    """A cell nested thousands deep (``_ = 1+1+…+1``) fails at once with Python's RecursionError.

    Before it runs a cell, ipykernel asks ``shell.should_run_async``, which compiles it to see whether
    it awaits — and IPython lets a RecursionError of that compile escape. ipykernel then logs it and
    never answers the cell: the grader waited the whole cell timeout (300 s) for each such cell.
    Here that question is answered "no" instead, and the cell runs as usual, raising the
    RecursionError that Python gives it (1.7 s for 60,000 terms, measured).
    """
    if shell is None or not hasattr(shell, "should_run_async"):
        return
    asks = shell.should_run_async

    def should_run_async(raw_cell, **kwargs):
        try:
            return asks(raw_cell, **kwargs)
        except Exception:  # noqa: BLE001 - RecursionError, or whatever else a compile raises: run it
            return False   # the usual way, where the same error reaches the cell's output

    shell.should_run_async = should_run_async


def prime(slot: str, payload: str) -> None:
    """Engine → kernel, right before a check cell: this slot's inputs (the judge's ``cases`` reply)."""
    _state["primed"] = (slot, json.loads(payload))
    _state["collected"] = None


def collect():
    """Engine ← kernel, right after the cell: the values (wire text), or ``None`` if none were made."""
    text, _state["collected"], _state["primed"] = _state["collected"], None, None
    return text


def _graded_run(exercise: str, run: Callable, slot: str | None = None) -> None:
    slot = slot or exercise
    primed = _state.get("primed")
    if not primed or primed[0] != slot:
        print(f"(graded run: {slot} is checked in its own cell)")
        return
    payload = primed[1]
    cases = wire.loads(payload["cases"])
    with forbidden(payload.get("forbid", ()), exercise):
        nodes = run_cases(run, cases, payload["seeds"])
    _state["collected"] = wire.pack(nodes)
    _state["primed"] = None
    print(f"{slot}: {len(nodes)} of {len(cases)} cases ran; the grader compares them with the "
          "course's answers")


def run_hidden(exercise: str) -> None:
    """The grader's cell after a visible check: run its hidden cases with the visible check's code."""
    run = _state["runs"].get(exercise)
    if run is None:
        raise RuntimeError(f"the check of {exercise} did not run, so its hidden check cannot")
    _graded_run(exercise, run, f"{exercise}/hidden")


def _cap_output(ip, limit: int) -> None:
    """Cut a cell's stdout/stderr after ``limit`` characters, before IPython or ipykernel keep it.

    IPython wraps ``sys.stdout.write`` anew for every cell and restores it afterwards, so the cap is
    put on top of that wrapper at the start of every cell.
    """
    state = {"n": 0, "cut": False}

    def wrap(stream):
        write = stream.write

        def capped(s, *args, **kwargs):
            if not isinstance(s, str):
                return write(s, *args, **kwargs)
            if state["n"] >= limit:
                if not state["cut"]:
                    state["cut"] = True
                    write(f"\n[output truncated by the grader after {limit} characters]\n")
                return len(s)
            state["n"] += len(s)
            if state["n"] > limit:
                write(s[: len(s) - (state["n"] - limit)])
                return len(s)
            return write(s, *args, **kwargs)

        stream.write = capped

    def on_cell(*args):
        state.update(n=0, cut=False)
        for stream in (sys.stdout, sys.stderr):
            wrap(stream)

    ip.events.register("pre_run_cell", on_cell)


# --- local mode: a judge process of this kernel's own ---------------------------------------------

class JudgeGone(RuntimeError):
    """The judge process had ended before a request was sent to it: ask a fresh one (the request had
    nothing to do with its end)."""


class JudgeCrashed(RuntimeError):
    """The judge died or stalled while answering *this* request (it is gone afterwards).

    ``how`` completes "the values made the judge …": ``"crash (signal 11)"``, ``"crash (exit status
    1)"``, ``"stall (over 120 s)"`` or ``"garble its reply"``; ``stalled``: whether it was killed for
    not answering in time.
    """

    def __init__(self, message: str, *, how: str, stalled: bool = False):
        super().__init__(message)
        self.how, self.stalled = how, stalled


def _judge_env() -> dict:
    env = dict(os.environ, MPLBACKEND="agg", PYTHONDONTWRITEBYTECODE="1")
    # the judge runs the very package this process imported (not whatever an install points at)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(_PACKAGE_DIR).parent),
                                         *filter(None, [os.environ.get("PYTHONPATH")])])
    env.pop("GPUCOURSE_RESULT_FD", None)
    return env


def _judge_command(args: list[str], *, private_network: bool) -> tuple[list[str], bool]:
    """``python -P -m gpucourse.grading.judge ARGS`` (-P: the package on PYTHONPATH, this one, never
    one in the current folder, another checkout) — under ``bwrap --unshare-net`` with
    ``private_network`` where bwrap exists; and whether it is."""
    import shutil

    argv = [sys.executable, "-P", "-m", "gpucourse.grading.judge", *args]
    bwrap = shutil.which("bwrap") if private_network else None
    if bwrap:
        argv = [bwrap, "--dev-bind", "/", "/", "--unshare-net", "--die-with-parent", "--", *argv]
    return argv, bwrap is not None


class JudgeHost:
    """One process that imports torch, IPython and the course once and forks the judges of a
    grading run (``python -m gpucourse.grading.judge --host``; see :func:`.judge.host`).

    Judges started each in its own interpreter held about 500 MB each of which most is the same
    torch (benchmarks/grading.py); forked ones share those pages until they write them, and start
    without importing anything — a judge that a submission's values crashed is back in a fraction
    of a second. With ``private_network`` the host, and so every judge it forks, runs in a network
    namespace of its own (``bwrap --unshare-net``): the ranks their reference runs start listen on
    a loopback no submission shares. Like a judge, the host dies with the thread that started it.
    """

    def __init__(self, *, private_network: bool = False, warm: bool = False):
        """``warm``: the host also imports what forking ranks needs (``torch._dynamo``), once for
        all its judges, instead of each judge that runs the course's answers on ranks for itself."""
        import socket
        import tempfile

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile(prefix="gpucourse-judge-host-")
        argv, _ = _judge_command(["--host", str(theirs.fileno()), *(["--warm"] if warm else [])],
                                 private_network=private_network)
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                         env=_judge_env(), pass_fds=[theirs.fileno()])
        finally:
            theirs.close()
        self.sock = ours
        self._forking = threading.Lock()
        self._changed = threading.Condition()
        self._forked: list[int] = []           # pids, in the order of the requests (one at a time)
        self._exited: dict[int, int | None] = {}
        self._ended = False
        self._reader = threading.Thread(target=self._read, name="judge host", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            with self._changed:
                if not data:                   # the host ended: so did its judges (parent-death signal)
                    self._ended = True
                    self._changed.notify_all()
                    return
                reply = json.loads(data)
                if "pid" in reply:
                    self._forked.append(reply["pid"])
                else:
                    self._exited[reply["exited"]] = reply["status"]
                self._changed.notify_all()

    def alive(self) -> bool:
        return not self._ended and self.proc.poll() is None

    def fork(self, argv: list[str], stdin: int, stdout: int, stderr: int, timeout: float = 600) -> "_ForkedJudge":
        """A judge forked with ``argv`` (:func:`.judge.main`'s), reading ``stdin``, writing ``stdout``."""
        import socket

        with self._forking, self._changed:
            try:
                socket.send_fds(self.sock, [json.dumps(argv).encode()], [stdin, stdout, stderr])
            except OSError as e:
                raise JudgeGone(f"the judge host has ended ({e})") from None
            if not self._changed.wait_for(lambda: self._forked or self._ended, timeout) or not self._forked:
                raise JudgeGone(f"the judge host did not fork a judge ({self._tail()})")
            return _ForkedJudge(self, self._forked.pop(0))

    def status(self, pid: int, timeout: float | None) -> tuple[bool, int | None]:
        """(ended, exit status) of a judge forked here, waiting up to ``timeout`` for its end."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exited or self._ended, timeout)
            if pid in self._exited:
                return True, self._exited[pid]
            return self._ended, None

    def _tail(self) -> str:
        try:
            self.log.seek(0)
            lines = self.log.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            lines = []
        return lines[-1] if lines else f"exit status {self.proc.poll()}"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(2)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)
        self.sock.close()
        self.log.close()


class _ForkedJudge:
    """What :class:`JudgeProcess` uses of a ``Popen``, for a judge that a :class:`JudgeHost` forked."""

    def __init__(self, host: JudgeHost, pid: int):
        self.host, self.pid = host, pid
        self.returncode: int | None = None
        self.stdin = self.stdout = None
        self._lock = threading.Lock()
        try:        # a handle on this very process: kill() can never reach another that reuses the pid
            self._pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    def _ended(self, status: int | None) -> int:
        with self._lock:                       # poll() is called from several threads: close it once
            self.returncode = -9 if status is None else status      # None: the host's end killed it
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            ended, status = self.host.status(self.pid, 0)
            if ended:
                self._ended(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            ended, status = self.host.status(self.pid, timeout)
            if not ended:
                raise subprocess.TimeoutExpired(f"judge {self.pid}", timeout)
            self._ended(status)
        return self.returncode

    def kill(self) -> None:
        import signal

        if self.poll() is None:
            with self._lock, contextlib.suppress(OSError):
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                elif self.returncode is None:
                    os.kill(self.pid, signal.SIGKILL)


class JudgeProcess:
    """A judge in a child process, spoken to in JSON lines over its stdin/stdout.

    One request at a time (a lock): :meth:`request` raises :class:`JudgeCrashed` when the judge
    ends or stalls while answering it, :class:`JudgeGone` when it had ended before.
    """

    def __init__(self, chapter: str, solutions: str | os.PathLike, *, local: bool, private_network: bool = False,
                 public: str | os.PathLike | None = None, host: JudgeHost | None = None):
        """``private_network``: run it in a network namespace of its own (``bwrap --unshare-net``), so
        the ranks its reference runs start listen on a loopback nobody else shares. ``public``: a
        public cases file (:mod:`.public`): a public judge, ``solutions`` then being the folder of the
        release notebook. ``host``: fork it from that :class:`JudgeHost` (whose network it shares)
        instead of starting an interpreter."""
        import tempfile

        self.chapter = chapter
        self.log = tempfile.NamedTemporaryFile(prefix="gpucourse-judge-", suffix=".log", delete=False)
        args = ["--chapter", chapter, "--solutions", str(solutions)]
        args += ["--public", str(public)] if public is not None else []
        self.wrapped = False
        try:
            if host is not None:
                self.proc = self._fork(host, args)
            else:
                argv, self.wrapped = _judge_command(args + (["--die-with-parent"] if local else []),
                                                    private_network=private_network)
                # local: a session of its own, so that the kernel's interrupt (Jupyter signals the
                # kernel's whole process group; nbgrader validate does so when a cell overruns) does
                # not kill it mid-way and read as "your values crashed the judge"; it still dies
                # with the kernel
                self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                             env=_judge_env(), close_fds=True, start_new_session=local)
        finally:
            # the judge writes to the open file, and its last line is read through self.log: the
            # name is not needed, and a judge that ends with its kernel leaves no file behind
            with contextlib.suppress(OSError):
                os.unlink(self.log.name)
        self.lock = threading.Lock()
        self.hello = self.request({"op": "hello"}, timeout=600)

    def _fork(self, host: JudgeHost, args: list[str]) -> _ForkedJudge:
        to_judge, from_judge = os.pipe(), os.pipe()      # (read, write) each
        try:
            proc = host.fork(args, to_judge[0], from_judge[1], self.log.fileno())
        except BaseException:
            for fd in (*to_judge, *from_judge):
                os.close(fd)
            raise
        os.close(to_judge[0])
        os.close(from_judge[1])
        proc.stdin, proc.stdout = os.fdopen(to_judge[1], "wb"), os.fdopen(from_judge[0], "rb")
        return proc

    def request(self, message: dict, timeout: float = 600) -> dict:
        """The judge's reply to ``message`` (a JSON object), within ``timeout`` seconds of sending it.

        Raises :class:`JudgeGone` if the judge had already ended, :class:`JudgeCrashed` if it ends
        or stalls (it is killed then) while answering, ``RuntimeError`` for an ``error`` reply.
        """
        with self.lock:
            gone = "the judge process has ended ({}), before this request"
            if self.proc.poll() is not None:
                raise JudgeGone(gone.format(self._tail()))
            try:
                self.proc.stdin.write((json.dumps(message) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, ConnectionResetError, ValueError):
                self._reap()                # it ended before it read the request: not the request's doing
                raise JudgeGone(gone.format(self._tail())) from None
            try:
                line = _read_line(self.proc.stdout, timeout)
            except BaseException:           # interrupted (Ctrl-C, the stop button): its reply would come
                self.close()                # out of step with the next request; the next check starts a
                raise                       # fresh judge
            if line is None:
                tail = self._tail()
                self.close()
                raise JudgeCrashed(f"the judge did not answer within {timeout:g} s; stopped it ({tail})",
                                   how=f"stall (over {timeout:g} s)", stalled=True)
            if not line.endswith(b"\n"):
                status = self._reap()
                if self.wrapped and status is not None and status > 128:
                    status = 128 - status          # bwrap exits 128 + N when the judge is killed by signal N
                how = (f"crash (signal {-status})" if status is not None and status < 0
                       else f"crash (exit status {status})")
                raise JudgeCrashed(f"the judge process ended while answering: {how} ({self._tail()})",
                                   how=how)
            try:
                reply = json.loads(line)
                if not isinstance(reply, dict):
                    raise ValueError(f"not a JSON object: {line[:80]!r}")
            except ValueError as e:         # out of step with its replies: it cannot be trusted again
                with contextlib.suppress(OSError):
                    self.proc.kill()
                self._reap()
                raise JudgeCrashed(f"the judge's reply could not be read ({e})",
                                   how="garble its reply") from None
            if "error" in reply:
                raise RuntimeError(f"the judge failed: {reply['error']}")
            return reply

    def _reap(self) -> int | None:
        """The exit status of a judge whose pipe closed (killed if it lingers)."""
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                self.proc.kill()
            return self.proc.wait()

    def _tail(self) -> str:
        try:
            text = os.pread(self.log.fileno(), 1 << 16, max(0, os.fstat(self.log.fileno()).st_size - (1 << 16)))
            text = text.decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            text = []
        return text[-1] if text else f"exit status {self.proc.poll()}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(Exception):
                f.close()
        with contextlib.suppress(Exception):
            self.log.close()


def _read_line(stream, timeout: float) -> bytes | None:
    """One line from a pipe, or ``None`` after ``timeout`` seconds."""
    import selectors

    fd = stream.fileno()
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return buf
            buf += chunk
    return buf


def find_solutions(chapter: str) -> Path | None:
    """The course's ``solutions/`` folder holding chapter ``chapter`` (``GPUCOURSE_SOLUTIONS`` first)."""
    candidates = []
    if os.environ.get("GPUCOURSE_SOLUTIONS"):
        candidates.append(Path(os.environ["GPUCOURSE_SOLUTIONS"]))
    candidates += [Path(_PACKAGE_DIR).parent / "solutions", Path.cwd() / "solutions", Path.cwd().parent / "solutions"]
    for folder in candidates:
        if folder.is_dir() and any(folder.glob(f"{chapter}_*.ipynb")):
            return folder
    return None


def find_public_judge(chapter: str, near=()) -> tuple[Path, Path] | None:
    """Where ``solutions/`` is absent: (the chapter's public cases file, the folder of its release
    notebook), found next to the package's course, in the folders ``near`` (and their ``public/``)
    or in the current folder's ``exercises/public`` — or ``None``."""
    from .public import find_public, release_folder

    public = find_public(chapter, near)
    if public is None:
        return None
    folder = release_folder(public, chapter, also=[*near, Path.cwd()])
    return None if folder is None else (public, folder)


def _local_judge(chapter: str) -> JudgeProcess:
    judges = _state.setdefault("judges", {})
    judge = judges.get(chapter)
    if judge is None or judge.proc.poll() is not None:
        solutions, public = find_solutions(chapter), None
        if solutions is None:
            found = find_public_judge(chapter, near=[Path.cwd()])
            if found is None:
                raise CheckFailed(f"cannot check chapter {chapter} here: neither the course's answers (its "
                                  "solutions/ folder) nor its public cases (exercises/public/"
                                  f"{chapter}_public_cases.json) are on this machine, and the check needs one "
                                  "of them to compare with. Set GPUCOURSE_SOLUTIONS=/path/to/solutions, run "
                                  "from the course's folder, or hand the notebook in: the instructor's grader "
                                  "decides.")
            public, solutions = found
        judge = JudgeProcess(chapter, solutions, local=True, public=public)
        judges[chapter] = judge
    return judge


#: set (to "1") where every check cell must also run its exercise's hidden check — nbgrader's
#: autograde, through the ``nbgrader_config.py`` that ``export-nbgrader`` writes
HIDDEN_CHECKS_VARIABLE = "GPUCOURSE_HIDDEN_CHECKS"


#: what a check prints where it was decided on the public cases (no ``solutions/`` here)
PUBLIC_PASS = "on the public cases — your instructor's grader draws new ones"


def _without_hidden_frames(tb):
    """``tb`` without the frames that set ``__tracebackhide__ = True`` (the harness's): a new chain
    of the learner's frames only, so the innermost frame shown is the learner's cell, not ours."""
    import types

    kept = []
    while tb is not None:
        if tb.tb_frame.f_locals.get("__tracebackhide__") is not True:
            kept.append(tb)
        tb = tb.tb_next
    new = None
    for entry in reversed(kept):
        new = types.TracebackType(new, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return new


def _show_failures_plainly() -> None:
    """In IPython, a :class:`CheckFailed` shows as the learner's cell and the judge's verdict — the
    traceback IPython would show with the harness's frames left out, the innermost one included
    (IPython always shows the innermost frame, hidden or not): no path of the grading code, which
    nbgrader would show students as feedback (issue 39). Still an error output (nbgrader and
    JupyterLab see a failed cell)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or getattr(shell, "_gpucourse_plain_failures", False):
        return

    def verdict(shell, etype, value, tb, tb_offset=None):
        mine = _without_hidden_frames(tb)
        stb = shell.InteractiveTB.structured_traceback(etype, value, mine, tb_offset=tb_offset)
        shell._showtraceback(etype, value, stb)
        return None            # shown already: IPython's CustomTB prints nothing more

    shell.set_custom_exc((CheckFailed,), verdict)
    shell._gpucourse_plain_failures = True


def _local_run(exercise: str, slot: str, run: Callable, *, hidden: bool) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython shows the learner's frames, not the harness's
    _show_failures_plainly()
    judge = _local_judge(exercise[:2])
    public = judge.hello.get("public")
    if public and hidden and not any(s["slot"] == slot for s in judge.hello["slots"]):
        print(f"{slot}: not checked here — only your instructor's grader, with the course's solutions, "
              "runs it (this machine has the public cases of the visible checks)")
        return
    note = "" if hidden else _not_the_courses_check(judge, exercise)
    try:
        reply = _judge_one(judge, exercise, slot, run)
    except CheckFailed as e:
        if note:
            raise CheckFailed(f"{e}\n({note})") from None
        raise
    if note:
        print(f"({note})")
    also_hidden = not hidden and os.environ.get(HIDDEN_CHECKS_VARIABLE) == "1" and any(
        s["slot"] == f"{exercise}/hidden" for s in judge.hello["slots"])
    if also_hidden:
        _judge_one(judge, exercise, f"{exercise}/hidden", run)
    if public:
        counts = reply.get("public", {})
        n, of = counts.get("cases", 0), counts.get("of", 0)
        size = f"{n} fixed inputs here" + (f"; it draws about {of}" if of > n else "")
        print(f"{exercise} passed ✓ {PUBLIC_PASS} and runs hidden checks too ({size})")
        return
    print(f"{exercise}{' hidden' if hidden else ''} passed ✓" + (" (and its hidden check)" if also_hidden else ""))


def _not_the_courses_check(judge: JudgeProcess, exercise: str) -> str:
    """A note when the cell that calls :func:`check_exercise` is not the course's check cell of
    ``exercise`` (edited, or from a copy of the notebook older than the course): its cases come from
    the course's judge of today, so an old cell's ``run`` and today's cases can disagree in ways that
    say nothing of the answer. ``""`` when it is the course's, or when this is not an IPython cell."""
    import linecache

    from .exercises import check_hash

    want = next((s.get("check_hash") for s in judge.hello.get("slots", []) if s.get("slot") == exercise), None)
    if not want:
        return ""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        cells = getattr(getattr(shell, "compile", None), "_filename_map", None) or {}
        # the cell that called check_exercise: the first frame out of the course's package (the cell's
        # source as IPython keeps it for tracebacks, whether or not the front end stores history)
        package = os.path.dirname(os.path.dirname(__file__)) + os.sep
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(package):
            frame = frame.f_back
        filename = frame.f_code.co_filename if frame is not None else ""
        cell = "".join(linecache.getlines(filename)) if filename in cells else ""
    except Exception:  # noqa: BLE001 - no IPython cell to compare: say nothing
        return ""
    if not cell or check_hash(cell) == want:
        return ""
    return (f"this check cell is not the course's current check of {exercise}: edited, or from an older copy "
            "of the notebook — the course's checks have changed since. Copy the check cell from the course's "
            "exercises/ notebook, or run `python -m gpucourse check` on this notebook: it restores the "
            "course's check cells by itself")


def _judge_one(judge: JudgeProcess, exercise: str, slot: str, run: Callable) -> dict:
    """Run the slot's cases with ``run`` here, let the judge compare; its ``cases`` reply."""
    __tracebackhide__ = True  # noqa: F841 - IPython shows the learner's frames, not the harness's
    public = judge.hello.get("public")
    if public and _state["seed"] is not None and _state["seed"] != public["seed"]:
        print(f"(gc.set_check_seed({_state['seed']}) has no effect here: without the course's solutions only "
              f"the public cases, seed {public['seed']}, can be checked)")
    seed = None if public else _state["seed"]
    reply = judge.request({"op": "cases", "slot": slot, "seed": seed})
    cases = wire.loads(reply["cases"])
    started = time.perf_counter()           # as the grader times its hidden cell: the cases, packed
    with forbidden(reply.get("forbid", ()), exercise):
        nodes = run_cases(run, cases, reply["seeds"])
    values = wire.pack(nodes)
    seconds = time.perf_counter() - started
    verdict = judge.request({"op": "compare", "slot": slot, "seed": reply["seed"], "values": values,
                             "seconds": seconds, "clock": "kernel"})
    if not verdict["passed"]:
        message = verdict["message"]
        if public and "public case" not in message.splitlines()[0]:
            message = f"{message}\n(checked on the public cases: your instructor's grader draws new ones)"
        raise CheckFailed(message)
    return reply
