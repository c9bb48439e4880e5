"""Floating-point formats from their bits: what fp32, fp16 and bf16 can represent, and what they lose.

A binary floating-point number is three bit fields — sign ``s``, exponent ``E`` (``e`` bits) and
mantissa/fraction ``M`` (``m`` bits) — and means

    normal numbers     (-1)^s × 1.M × 2^(E - bias)        for 1 <= E <= 2^e - 2,  bias = 2^(e-1) - 1
    subnormal numbers  (-1)^s × 0.M × 2^(1 - bias)        for E = 0 (gradual underflow down to 0)
    inf / NaN                                             for E = 2^e - 1 (all ones)

So the *exponent* bits buy range and the *mantissa* bits buy precision:

    format   bits  e   m   largest      smallest normal  smallest subnormal  eps (1 → next)
    fp32      32   8  23   3.4e38       1.2e-38          1.4e-45             1.2e-7
    fp16      16   5  10   65504        6.1e-5           6.0e-8              9.8e-4
    bf16      16   8   7   3.4e38       1.2e-38          9.2e-41             7.8e-3

fp16 keeps more precision but has a tiny range: a gradient below 6e-8 becomes 0 (*underflow*) and
anything above 65504 becomes inf (*overflow*) — which is why fp16 training needs loss scaling.
bf16 is fp32 with the last 16 mantissa bits cut off: the same range as fp32, less precision, no
loss scaling needed.

Everything here is computed from the bit widths, and ``tests/test_number_formats.py`` checks it
against ``torch.finfo`` and against real casts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..runtime import check_int

__all__ = ["FloatFormat", "float_format", "format_table", "bit_fields", "BitFields", "CastReport", "cast_report", "underflow_fraction", "lost_update_fraction"]

# (exponent bits, mantissa bits) of the IEEE-754-style formats PyTorch trains with
_LAYOUTS = {
    torch.float64: ("fp64", 11, 52),
    torch.float32: ("fp32", 8, 23),
    torch.float16: ("fp16", 5, 10),
    torch.bfloat16: ("bf16", 8, 7),
}
# integer dtype of the same width, to read the raw bits of a float tensor with .view()
_SAME_WIDTH_INT = {64: torch.int64, 32: torch.int32, 16: torch.int16}


def _check_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float16, got {type(dtype).__name__} "
                        f"{dtype!r}")
    if dtype not in _LAYOUTS:
        allowed = ", ".join(str(d) for d in _LAYOUTS)
        raise ValueError(f"no bit layout known for {dtype}; allowed: {allowed}")


@dataclass(frozen=True)
class FloatFormat:
    """An IEEE-754-style binary format described by its bit widths; every limit is derived from them.

    Args:
        name: short name (``"fp16"``).
        exponent_bits: width ``e`` of the exponent field.
        mantissa_bits: width ``m`` of the stored fraction (the leading 1 of normal numbers is implicit).
        dtype: the matching ``torch.dtype``, if any.

    Example::

        >>> fp16 = FloatFormat("fp16", exponent_bits=5, mantissa_bits=10)
        >>> fp16.max, fp16.smallest_normal, fp16.eps
        (65504.0, 6.103515625e-05, 0.0009765625)
        >>> fp16.smallest_subnormal == 2.0 ** -24
        True

    .. warning::
        Only formats with IEEE semantics (all-ones exponent reserved for inf/NaN) are described
        correctly. Some fp8 variants (``float8_e4m3fn``) give up infinities to gain range, so their
        ``max`` differs from the formula here; ask ``torch.finfo`` for those.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    dtype: torch.dtype | None = None

    def __post_init__(self):
        for field_name in ("exponent_bits", "mantissa_bits"):
            check_int(field_name, getattr(self, field_name), 1)
        if self.exponent_bits < 2:
            raise ValueError(f"exponent_bits must be >= 2 (one value is reserved for inf/NaN), "
                             f"got {self.exponent_bits}")

    @property
    def bits(self) -> int:
        """Total width: sign + exponent + mantissa."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        """Stored exponent E means 2^(E - bias)."""
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def max(self) -> float:
        """Largest finite value: exponent field 2^e - 2 (= bias after the bias), mantissa all ones."""
        return math.ldexp(2.0 - 2.0 ** -self.mantissa_bits, self.bias)

    @property
    def smallest_normal(self) -> float:
        """Smallest positive number with full precision (``torch.finfo(dtype).tiny``)."""
        return math.ldexp(1.0, 1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        """Smallest positive number at all; half of it and below round to 0."""
        return math.ldexp(1.0, 1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Distance from 1 to the next representable number: the relative precision."""
        return 2.0 ** -self.mantissa_bits

    @property
    def decimal_digits(self) -> float:
        """About how many significant decimal digits the (m + 1)-bit significand holds."""
        return (self.mantissa_bits + 1) * math.log10(2)


def float_format(dtype: torch.dtype) -> FloatFormat:
    """The :class:`FloatFormat` of a PyTorch floating-point dtype.

    Args:
        dtype: ``torch.float64``, ``torch.float32``, ``torch.float16`` or ``torch.bfloat16``.

    Example::

        >>> import torch
        >>> bf16 = float_format(torch.bfloat16)
        >>> bf16.bits, bf16.exponent_bits, bf16.mantissa_bits
        (16, 8, 7)
        >>> bf16.max == torch.finfo(torch.bfloat16).max   # the same range as fp32 ...
        True
        >>> bf16.eps                                       # ... with far less precision
        0.0078125

    .. warning::
        The same 16 bits buy different things: fp16 has 8x finer precision than bf16 but overflows
        above 65504 and underflows below 6e-8. Choosing between them is choosing range or precision.
    """
    _check_dtype(dtype)
    name, e, m = _LAYOUTS[dtype]
    return FloatFormat(name, e, m, dtype)


def format_table(dtypes=(torch.float32, torch.float16, torch.bfloat16)) -> str:
    """A printable table of bits, range and precision for ``dtypes``.

    Args:
        dtypes: formats to list, each one :func:`float_format` knows.

    Example::

        >>> import torch
        >>> print(format_table([torch.float16]))
        format  bits  exp  mant        max  smallest normal  smallest subnormal       eps  digits
        fp16      16    5    10  6.550e+04        6.104e-05           5.960e-08  9.77e-04     3.3

    .. warning::
        ``digits`` is the precision *relative* to a number's size, not a count of decimals: fp16
        holds 1000.5 as 1000.5 but 10000.5 as 10000.0.
    """
    lines = [f"{'format':<6}  {'bits':>4}  {'exp':>3}  {'mant':>4}  {'max':>9}  {'smallest normal':>15}  "
             f"{'smallest subnormal':>18}  {'eps':>8}  {'digits':>6}"]
    for dtype in dtypes:
        f = float_format(dtype)
        lines.append(f"{f.name:<6}  {f.bits:>4}  {f.exponent_bits:>3}  {f.mantissa_bits:>4}  {f.max:>9.3e}  "
                     f"{f.smallest_normal:>15.3e}  {f.smallest_subnormal:>18.3e}  {f.eps:>8.2e}  "
                     f"{f.decimal_digits:>6.1f}")
    return "\n".join(lines)


@dataclass(frozen=True)
class BitFields:
    """The stored bits of one number: ``sign``, ``exponent`` and ``mantissa`` as strings of 0/1.

    Args:
        sign, exponent, mantissa: the bit fields, most significant bit first.
        value: the number these bits mean (after rounding to the format).

    Example::

        >>> import torch
        >>> b = bit_fields(-0.75, torch.float16)
        >>> b.sign, b.exponent, b.mantissa, b.value
        ('1', '01110', '1000000000', -0.75)

    .. warning::
        An all-ones exponent means inf (mantissa 0) or NaN, not a large number.
    """

    sign: str
    exponent: str
    mantissa: str
    value: float

    def __str__(self) -> str:
        return f"{self.sign} {self.exponent} {self.mantissa}"


def bit_fields(x: float, dtype: torch.dtype) -> BitFields:
    """How ``x`` is stored in ``dtype``: its sign, exponent and mantissa bits, and the value kept.

    Args:
        x: a Python number; it is rounded to ``dtype`` first, as a cast would.
        dtype: one of the formats :func:`float_format` knows.

    Example::

        >>> import torch
        >>> print(bit_fields(1.0, torch.float16))            # 1.0 x 2^(15 - 15)
        0 01111 0000000000
        >>> print(bit_fields(-2.5, torch.bfloat16))          # -1.01b x 2^(128 - 127)
        1 10000000 0100000
        >>> bit_fields(1 + 2**-9, torch.bfloat16).value       # too fine for 7 mantissa bits
        1.0

    .. warning::
        The value *kept* can differ from ``x``: ``bit_fields(0.1, torch.float16).value`` is
        0.0999755859375. Every cast to a 16-bit format rounds.
    """
    fmt = float_format(dtype)
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise TypeError(f"x must be a Python int or float, got {type(x).__name__} {x!r}")
    stored = torch.tensor([x], dtype=torch.float64).to(dtype)
    raw = int(stored.view(_SAME_WIDTH_INT[fmt.bits]).item()) & ((1 << fmt.bits) - 1)
    bits = format(raw, f"0{fmt.bits}b")
    return BitFields(bits[0], bits[1:1 + fmt.exponent_bits], bits[1 + fmt.exponent_bits:],
                     stored.double().item())


@dataclass(frozen=True)
class CastReport:
    """What a cast did to the non-zero finite elements of a tensor (counts and shares).

    Args:
        dtype: the format cast to.
        total: non-zero finite elements before the cast.
        underflow: of those, how many became exactly 0.
        subnormal: how many became subnormal (non-zero, but with fewer significant bits).
        overflow: how many became ±inf.

    Example::

        >>> import torch
        >>> r = CastReport(torch.float16, total=4, underflow=1, subnormal=2, overflow=0)
        >>> r.underflow_fraction, r.subnormal_fraction
        (0.25, 0.5)

    .. warning::
        The shares are of the non-zero finite elements only; a tensor that is mostly zeros (after
        ReLU, say) can show a large share of a small count.
    """

    dtype: torch.dtype
    total: int
    underflow: int
    subnormal: int
    overflow: int

    def _share(self, n: int) -> float:
        return n / self.total if self.total else 0.0

    @property
    def underflow_fraction(self) -> float:
        return self._share(self.underflow)

    @property
    def subnormal_fraction(self) -> float:
        return self._share(self.subnormal)

    @property
    def overflow_fraction(self) -> float:
        return self._share(self.overflow)

    def __str__(self) -> str:
        return (f"{float_format(self.dtype).name}: {self.underflow_fraction:7.2%} flushed to 0, "
                f"{self.subnormal_fraction:7.2%} subnormal, {self.overflow_fraction:7.2%} overflow to inf "
                f"(of {self.total} non-zero values)")


def cast_report(tensor: torch.Tensor, dtype: torch.dtype) -> CastReport:
    """Cast ``tensor`` to ``dtype`` and count what underflowed, became subnormal or overflowed.

    Args:
        tensor: any floating-point tensor (gradients, activations, ...).
        dtype: the format to test, e.g. ``torch.float16``.

    Example::

        >>> import torch
        >>> g = torch.tensor([1e-3, 1e-6, 1e-9, 1e5])
        >>> r = cast_report(g, torch.float16)
        >>> r.underflow, r.subnormal, r.overflow     # 1e-9 -> 0, 1e-6 subnormal, 1e5 -> inf
        (1, 1, 1)
        >>> cast_report(g, torch.bfloat16).underflow  # bf16 has fp32's range
        0

    .. warning::
        Elements that are already 0, inf or NaN are not counted. And a cast is not the only place
        values are lost: in fp16 autocast the *backward pass itself* produces fp16 activation
        gradients, so small ones vanish before any final cast could be checked.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise TypeError(f"tensor must be a floating-point torch.Tensor, got "
                        f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
    fmt = float_format(dtype)
    t = tensor.detach()
    keep = (t != 0) & torch.isfinite(t)
    cast = t.to(dtype)
    magnitude = cast.abs().double()
    return CastReport(
        dtype=dtype,
        total=int(keep.sum()),
        underflow=int((keep & (cast == 0)).sum()),
        subnormal=int((keep & (magnitude > 0) & (magnitude < fmt.smallest_normal)).sum()),
        overflow=int((keep & torch.isinf(cast)).sum()),
    )


def underflow_fraction(tensor: torch.Tensor, dtype: torch.dtype) -> float:
    """Share of the non-zero finite elements of ``tensor`` that become exactly 0 in ``dtype``.

    Args:
        tensor: e.g. a gradient.
        dtype: the format to test.

    Example::

        >>> import torch
        >>> underflow_fraction(torch.tensor([1e-2, 1e-9, 2e-9, 0.0]), torch.float16)
        0.6666666666666666

    .. warning::
        A share of 0 does not mean nothing was lost: values in the subnormal range survive with
        fewer significant bits (see :func:`cast_report`).
    """
    return cast_report(tensor, dtype).underflow_fraction


def lost_update_fraction(weights: torch.Tensor, updates: torch.Tensor, dtype: torch.dtype) -> float:
    """Share of non-zero ``updates`` that change nothing when ``weights + updates`` is done in ``dtype``.

    This is why mixed precision keeps *fp32 master weights*: an update smaller than about
    ``eps/2 × |weight|`` rounds away completely in a low-precision weight.

    Args:
        weights: the parameters (any float dtype; they are cast to ``dtype``).
        updates: what the optimizer adds, e.g. ``-lr * grad``; same shape as ``weights``.
        dtype: the format the weights are stored in.

    Example::

        >>> import torch
        >>> w = torch.ones(4)
        >>> u = torch.tensor([1e-1, 1e-3, 1e-4, 0.0])
        >>> lost_update_fraction(w, u, torch.bfloat16)   # eps(bf16) = 2^-7: 1e-3 and 1e-4 vanish
        0.6666666666666666
        >>> lost_update_fraction(w, u, torch.float32)
        0.0

    .. warning::
        Training a model whose *weights* are bf16 or fp16 (``model.half()``, Apex O3) silently
        drops such updates; learning stalls without any error.
    """
    if not isinstance(weights, torch.Tensor) or not isinstance(updates, torch.Tensor):
        raise TypeError("weights and updates must be tensors")
    if weights.shape != updates.shape:
        raise ValueError(f"weights and updates must have the same shape, got {tuple(weights.shape)} "
                         f"and {tuple(updates.shape)}")
    _check_dtype(dtype)
    w = weights.detach().to(dtype)
    changed = (w + updates.detach().to(dtype)) != w
    active = updates != 0
    n = int(active.sum())
    return float((active & ~changed).sum()) / n if n else 0.0


