"""Where mixed precision is fast, and where it is not: a training step timed op by op.

autocast makes *matrix multiplications and convolutions* run in bf16/fp16. Those are compute-bound,
and the hardware does far more low-precision multiply-adds per cycle (NVIDIA Tensor Cores; on
CPUs AMX and AVX-512-bf16). Everything else — activations, residual adds, normalisation, the
optimizer — is *element-wise*: a few operations per value loaded from memory, limited by memory
bandwidth, not by arithmetic. Lower precision does not make those faster on a CPU, and autocast
*adds* work: it casts each fp32 weight to bf16 every step.

So the speed-up of a model is bounded by Amdahl's law over the share ``p`` of its fp32 step spent
in matmuls: with matmuls ``s`` times faster, at most ``1 / ((1 - p) + p / s)``.
:func:`op_time_shares` measures ``p`` without a profiler; :class:`ElementwiseNet` is a model where
``p`` is small; ``benchmarks/mixed_precision.py`` puts both next to the matmul-heavy MLP.
"""

from __future__ import annotations

import textwrap
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime import (Timing, bf16_hardware_note, check_int, check_number, check_positive,
                       check_type, cpu_supports_bf16, has_bf16_units, measure)

__all__ = ["ElementwiseNet", "training_step", "op_time_shares", "OpTimes", "PrecisionRun",
           "compare_precisions", "explain_bf16_speedup", "plot_time_split"]

# aten ops that are matrix products (what autocast lowers to bf16/fp16 for speed)
_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "convolution",
               "_convolution", "convolution_backward", "mkldnn_convolution", "_mkldnn_mm"}
_CAST_OPS = {"_to_copy", "copy_", "to", "_autocast_to_reduced_precision", "_autocast_to_full_precision"}


class ElementwiseNet(nn.Module):
    """A model whose time goes into element-wise layers: narrow linears, each followed by gating.

    Every block is ``h = Linear(x)``, then ``ops`` times ``h = silu(h) * tanh(h) + h``, then
    ``x = x + h``. With ``width=32`` a linear does 32 multiply-adds per value it produces, while
    the element-wise ops each touch every value again, so most of the step is memory traffic.

    Args:
        width: features per layer (small = element-wise bound).
        depth: number of blocks.
        ops: gating repetitions per block.

    Example::

        >>> import torch
        >>> ElementwiseNet(width=8, depth=2)(torch.randn(5, 8)).shape
        torch.Size([5, 8])

    .. warning::
        Expect no speed-up from autocast here: most of its time is in ops autocast does not make
        faster — only a profile of *your* model says which kind it is.
    """

    def __init__(self, width: int = 32, depth: int = 4, ops: int = 2):
        super().__init__()
        for name, v in (("width", width), ("depth", depth), ("ops", ops)):
            check_int(name, v, 1)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # (B, width) -> (B, width)
        for layer in self.layers:
            h = layer(x)
            for _ in range(self.ops):
                h = F.silu(h) * torch.tanh(h) + h
            x = x + h
        return x


def training_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *,
                  dtype: torch.dtype | None = None, device_type: str | None = None, scaler=None,
                  lr: float = 1e-3) -> Callable[[], float]:
    """A function that does one SGD training step (MSE loss) — what the speed comparisons time.

    Args:
        model, inputs, targets: the model and one batch on its device.
        dtype: ``None`` for fp32, or the autocast dtype (``torch.bfloat16``, ``torch.float16``).
        device_type: defaults to the device type of ``inputs``.
        scaler: a loss scaler for fp16 (``None`` otherwise).
        lr: SGD learning rate.

    Returns:
        ``step()`` → the loss as a float. Every call changes the model's parameters.

    Example::

        >>> import torch
        >>> from gpucourse import MLP
        >>> step = training_step(MLP(8, 8), torch.randn(4, 8), torch.randn(4, 8), dtype=torch.bfloat16)
        >>> isinstance(step(), float)
        True

    .. warning::
        Time these with the same number of threads, inputs and warm-up for every dtype; the first
        call of each dtype pays for one-time kernel selection (``gc.measure`` warms up).
    """
    device_type = device_type or inputs.device.type
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = model(inputs)
        loss = F.mse_loss(out.float(), targets)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        return float(loss.detach())

    return step


@dataclass
class OpTimes:
    """Wall time per aten operator during one call, and its split into matmul / cast / other.

    Args:
        per_op: seconds per aten op name (``"mm"``, ``"_to_copy"``, ``"relu"`` ...).
        total: their sum.

    Example::

        >>> t = OpTimes(Counter(mm=0.03, _to_copy=0.01, relu=0.01), 0.05)
        >>> print(t)
        matmul 60.0% | casts 20.0% | element-wise and other 20.0%

    .. warning::
        Ops are classified by name; a custom or fused kernel that does a matmul under another
        name counts as "other".
    """

    per_op: Counter
    total: float

    def share(self, kind: str) -> float:
        """Share of the total in ``"matmul"``, ``"cast"`` or ``"other"`` ops."""
        if kind not in ("matmul", "cast", "other"):
            raise ValueError(f"kind must be 'matmul', 'cast' or 'other', got {kind!r}")
        return self.seconds(kind) / self.total if self.total > 0 else 0.0

    def seconds(self, kind: str) -> float:
        """Seconds spent in ``"matmul"``, ``"cast"`` or ``"other"`` ops."""
        if kind not in ("matmul", "cast", "other"):
            raise ValueError(f"kind must be 'matmul', 'cast' or 'other', got {kind!r}")
        ops = {"matmul": _MATMUL_OPS, "cast": _CAST_OPS}
        if kind == "other":
            return sum(t for op, t in self.per_op.items() if op not in _MATMUL_OPS | _CAST_OPS)
        return sum(t for op, t in self.per_op.items() if op in ops[kind])

    def __str__(self) -> str:
        return (f"matmul {self.share('matmul'):5.1%} | casts {self.share('cast'):5.1%} | "
                f"element-wise and other {self.share('other'):5.1%}")


class _TimeOps(TorchDispatchMode):
    """Times every aten op that reaches the dispatcher (after autocast has chosen dtypes)."""

    def __init__(self):
        super().__init__()
        self.per_op: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.per_op[func.overloadpacket.__name__] += time.perf_counter() - start
        return out


def op_time_shares(fn: Callable[[], object], *, warmup: int = 1) -> OpTimes:
    """Run ``fn()`` once (after ``warmup`` untimed calls) and time each aten op it executes.

    A small profiler: a ``TorchDispatchMode`` sees every operator — forward, backward and optimizer
    — with the dtypes autocast chose, so casts show up as ``_to_copy``.

    Args:
        fn: the work to split, e.g. a :func:`training_step`.
        warmup: untimed calls first (kernel selection, caches).

    Example::

        >>> import torch
        >>> a = torch.randn(64, 64)
        >>> t = op_time_shares(lambda: (a @ a).relu())
        >>> sorted(t.per_op), 0 < t.share("matmul") <= 1
        (['mm', 'relu'], True)

    .. warning::
        Timing each op adds a little overhead per op (and a device sync on GPUs), so use it for
        shares, not for absolute step times — :func:`gpucourse.measure` is for those.
    """
    check_int("warmup", warmup, 0)
    for _ in range(warmup):
        fn()
    with _TimeOps() as timer:
        fn()
    return OpTimes(timer.per_op, sum(timer.per_op.values()))


@dataclass
class PrecisionRun:
    """One model timed in one precision: the step :class:`~gpucourse.Timing` and its :class:`OpTimes`.

    Args:
        timing: repeated step times.
        split: one step's time per op kind.
        dtype: ``None`` (fp32), ``torch.bfloat16`` or ``torch.float16``.

    Example::

        >>> run = PrecisionRun(Timing("MLP fp32", [0.2, 0.1, 0.3]), OpTimes(Counter(mm=0.1), 0.1), None)
        >>> run.timing.median, run.split.share("matmul")
        (0.2, 1.0)

    .. warning::
        ``split`` comes from one extra, separately timed step, so its total differs a little from
        ``timing.median``; use it for shares.
    """

    timing: Timing
    split: OpTimes
    dtype: torch.dtype | None


def _dtype_name(dtype) -> str:
    return {None: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def compare_precisions(make_model: Callable[[], nn.Module], batch: int, in_features: int,
                       out_features: int | None = None, *, device: str = "cpu",
                       dtypes=(None, torch.bfloat16), repeats: int = 5, warmup: int = 2,
                       name: str = "model", seed: int = 0) -> list[PrecisionRun]:
    """Time a training step of fresh, identical models in each precision, and split each step's time.

    Args:
        make_model: builds the model (called once per dtype, after ``torch.manual_seed(seed)``).
        batch, in_features, out_features: shape of the random regression batch
            (``out_features`` defaults to ``in_features``).
        device: ``"cpu"`` or ``"cuda"``.
        dtypes: ``None`` (fp32, put it first: it is the baseline), ``torch.bfloat16``,
            ``torch.float16`` (gets a :class:`~gpucourse.LossScaler`).
        repeats, warmup: passed to :func:`gpucourse.measure`.
        name: label prefix, e.g. ``"MLP"`` → ``"MLP bf16 (cpu)"``.

    Example::

        >>> from gpucourse import MLP
        >>> runs = compare_precisions(lambda: MLP(16, 16), 8, 16, repeats=1, warmup=0, name="tiny")
        >>> [r.timing.name for r in runs]
        ['tiny fp32 (cpu)', 'tiny bf16 (cpu)']

    .. warning::
        The ratio depends on the hardware (bf16 units or not), the number of threads and the
        model's shape. Compare runs of the same call on the same idle machine only.
    """
    from .loss_scaling import LossScaler   # imported here: loss_scaling does not depend on this module

    for dtype in dtypes:
        if dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(f"dtypes may contain None, torch.float16 and torch.bfloat16, got {dtype!r}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, in_features, generator=g).to(device)
    y = torch.randn(batch, out_features or in_features, generator=g).to(device)
    runs = []
    for dtype in dtypes:
        torch.manual_seed(seed)
        scaler = LossScaler() if dtype is torch.float16 else None
        step = training_step(make_model().to(device), x, y, dtype=dtype, scaler=scaler)
        timing = measure(step, repeats=repeats, warmup=warmup, name=f"{name} {_dtype_name(dtype)} ({device})")
        runs.append(PrecisionRun(timing, op_time_shares(step, warmup=0), dtype))
    return runs


def explain_bf16_speedup(ratio: float, matmul_share: float, features: dict[str, bool] | None = None, *,
                         name: str = "the model") -> str:
    """How to read a measured bf16-vs-fp32 ratio, given the matmul share and this CPU's bf16 units.

    The reading branches on the measurement and the hardware, never on one machine's result: with
    AMX / AVX-512-bf16 a matmul-heavy step can gain up to Amdahl's bound ``1 / (1 - p)``; without
    them bf16 matmuls are converted or emulated and the step gets slower.

    Args:
        ratio: fp32 time / bf16 time (``gc.speedup(fp32.timing, bf16.timing)``; > 1 is faster).
        matmul_share: ``p``, the share of the fp32 step spent in matmuls (``OpTimes.share("matmul")``).
        features: :func:`~gpucourse.cpu_supports_bf16`'s answer (detected when ``None``).
        name: the model's name in the text.

    Example::

        >>> amx = {"amx_bf16": True, "avx512_bf16": True, "onednn_bf16": True}
        >>> explain_bf16_speedup(1.8, 0.9, amx, name="MLP")[:46]
        'MLP: bf16 made the step 1.80x as fast as fp32.'
        >>> explain_bf16_speedup(0.02, 0.9, dict.fromkeys(amx, False), name="MLP")[:47]
        'MLP: bf16 made the step 50x slower (0.02x fp32)'
    """
    check_positive("ratio", ratio)
    check_number("matmul_share", matmul_share, 0.0, maximum=1.0)
    features = cpu_supports_bf16() if features is None else check_type("features", features, dict)
    bound = f"{1 / (1 - matmul_share):.1f}x" if matmul_share < 1 else "no limit"
    if ratio >= 1.1:
        head = f"{name}: bf16 made the step {ratio:.2f}x as fast as fp32."
    elif ratio >= 0.9:
        head = f"{name}: bf16 made the step about as fast as fp32 ({ratio:.2f}x)."
    else:
        slower = f"{1 / ratio:.{0 if ratio < 0.1 else 1}f}x"
        head = f"{name}: bf16 made the step {slower} slower ({ratio:.2g}x fp32)."
    if matmul_share < 1 and ratio > 1.1 / (1 - matmul_share):    # beyond Amdahl's bound: noise
        return textwrap.fill(f"{head} That is more than Amdahl's law allows — matmuls were {matmul_share:.0%} "
                             f"of the fp32 step, so even free matmuls give at most {bound} — so the two "
                             f"timings were not taken under the same conditions (the machine was busier "
                             f"during one of them). Run the cell again on a quiet machine.", 100)
    if not has_bf16_units(features) and matmul_share < 0.5 and ratio >= 0.5:
        how = "converted to fp32" if features.get("onednn_bf16") else "emulated"
        return textwrap.fill(f"{head} Matmuls were {matmul_share:.0%} of the fp32 step, too little for bf16 "
                             f"to matter — and this CPU has no AMX or AVX-512-bf16, so its bf16 matmuls are "
                             f"{how} anyway.", 100)
    if not has_bf16_units(features):
        why = bf16_hardware_note(features)[0].upper() + bf16_hardware_note(features)[1:] + "."
        if ratio >= 1.1:
            why += (" (A gain all the same: perhaps the CPU's flags could not be read — only Linux's "
                    "/proc/cpuinfo is — and it does have bf16 units.)")
        return textwrap.fill(f"{head} {why}", 100)
    amdahl = (f"Matmuls were {matmul_share:.0%} of the fp32 step, so even free matmuls give at most "
              f"{bound} (Amdahl's law)")
    if ratio >= 1.1:
        why = ("the matmuls ran on this CPU's bf16 units; the casts and the unchanged element-wise work "
               "keep the step below that bound.")
    elif matmul_share < 0.5:
        why = "too little of this step is matmul for bf16 to matter, and the casts eat what is left."
    elif ratio >= 0.9:
        why = ("this CPU has bf16 units, so a gain was possible: at this size the casts cost about what "
               "the matmuls saved, or the machine was busy — benchmarks/mixed_precision.py runs a larger "
               "batch (run it on an idle machine).")
    else:
        why = ("slower although this CPU has bf16 units: at this size the casts of every weight cost more "
               "than the matmuls saved, or the machine was busy — benchmarks/mixed_precision.py runs a "
               "larger batch (run it on an idle machine).")
    return textwrap.fill(f"{head} {amdahl}; {why}", 100)


def plot_time_split(runs: list[PrecisionRun], ax=None):
    """Stacked bars: each run's median step time split into matmul, cast and other ops.

    Args:
        runs: what :func:`compare_precisions` returned (several calls may be concatenated).
        ax: matplotlib axes to draw into (a new figure if ``None``).

    Example::

        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> from collections import Counter
        >>> run = PrecisionRun(Timing("m fp32", [0.01]), OpTimes(Counter(mm=0.008, relu=0.002), 0.01), None)
        >>> ax = plot_time_split([run])
        >>> len(ax.patches)                     # matmul, cast, other
        3

    .. warning::
        Bars of different machines or thread counts are not comparable; draw one run of
        :func:`compare_precisions` per figure.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 + 0.45 * len(runs)))
    labels = [r.timing.name for r in runs]
    left = [0.0] * len(runs)
    for kind, color, text in (("matmul", "C0", "matmul"), ("cast", "C3", "casts"),
                              ("other", "C2", "element-wise & other")):
        widths = [r.timing.median * 1e3 * r.split.share(kind) for r in runs]
        ax.barh(labels, widths, left=left, color=color, label=text)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set(xlabel="ms per training step (median)", title="Where a training step's time goes")
    ax.legend(loc="lower right")
    return ax
