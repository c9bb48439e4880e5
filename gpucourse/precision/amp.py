"""Automatic mixed precision (AMP) today: ``torch.autocast`` + a loss scaler, fp32 master weights.

The recipe that replaced NVIDIA Apex's ``amp.initialize(model, optimizer, opt_level="O1"/"O2")``::

    scaler = torch.amp.GradScaler(device_type)            # or gc.LossScaler(); not needed for bf16
    for inputs, targets in loader:
        optimizer.zero_grad()
        with torch.autocast(device_type, dtype=torch.float16):   # 1) forward in low precision
            loss = loss_fn(model(inputs), targets)
        scaler.scale(loss).backward()                      # 2) backward outside autocast, scaled
        scaler.unscale_(optimizer)                         # 3) true gradients before clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)                             # 4) skipped if a gradient is inf/NaN
        scaler.update()                                    # 5) adapt the scale

* The parameters stay fp32 (*master weights*): autocast casts them to fp16/bf16 per op, inside the
  ``with`` block, and the backward of that cast returns fp32 gradients.
* autocast chooses per op: matmuls and convolutions in low precision (that is where the speed is),
  reductions and losses that need range/precision in fp32, everything else in whatever dtype its
  inputs have. :func:`autocast_op_dtypes` shows the choice for any code.
* With ``DistributedDataParallel`` nothing changes: wrap the model as usual, create one scaler per
  process. DDP all-reduces the gradients inside ``backward()``, so every rank unscales the *same*
  gradients, finds the same inf/NaN and skips the same steps — the scalers stay in sync by
  themselves.
* autocast state is *thread-local*. Code that runs a model in other threads (DataParallel
  replicas) must enter autocast inside the replica's ``forward`` — :class:`AutocastModule`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["amp_step", "AmpStepResult", "AutocastModule", "autocast_op_dtypes", "OpRecord",
           "format_op_table"]

_LOW = (torch.float16, torch.bfloat16)


def _check_autocast_args(device_type, dtype) -> None:
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if dtype is not None and dtype not in _LOW:
        raise ValueError(f"dtype must be torch.float16, torch.bfloat16 or None (no autocast), got {dtype!r}")


@dataclass(frozen=True)
class AmpStepResult:
    """What one :func:`amp_step` did.

    Args:
        loss: the (unscaled) loss of this step.
        scale: the loss scale used for the backward pass (``None`` without a scaler).
        skipped: ``True`` if the optimizer step was skipped because a gradient was inf/NaN.
        grad_norm: total gradient norm before clipping (only when ``max_grad_norm`` was given).

    Example::

        >>> r = AmpStepResult(loss=0.7, scale=65536.0, skipped=False, grad_norm=None)
        >>> r.skipped
        False

    .. warning::
        ``skipped`` is read from the scale going down in ``update()``; a scaler with
        ``enabled=False`` never reports a skipped step, even if the gradients were inf/NaN.
    """

    loss: float
    scale: float | None
    skipped: bool
    grad_norm: float | None


def amp_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor,
             loss_fn: Callable, *, dtype: torch.dtype | None = torch.bfloat16, device_type: str | None = None,
             scaler=None, max_grad_norm: float | None = None) -> AmpStepResult:
    """One mixed-precision training step; works unchanged for a plain model and a DDP-wrapped one.

    Args:
        model: the model (fp32 parameters), possibly wrapped in ``DistributedDataParallel``.
        optimizer: its optimizer.
        inputs, targets: one batch, already on the model's device.
        loss_fn: ``loss_fn(outputs, targets)`` → scalar loss.
        dtype: autocast's low-precision type (``torch.bfloat16``, ``torch.float16``), or ``None``
            for a plain fp32 step.
        device_type: ``"cpu"`` or ``"cuda"``; defaults to the device type of ``inputs``.
        scaler: a :class:`~gpucourse.LossScaler` or ``torch.amp.GradScaler`` (one per process), or
            ``None`` — fine for bf16 and fp32, risky for fp16.
        max_grad_norm: clip the *unscaled* gradients to this total norm.

    Returns:
        :class:`AmpStepResult`.

    Example::

        >>> import torch
        >>> from gpucourse import MLP
        >>> from gpucourse import LossScaler
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> model = MLP(8, 16, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> x, y = torch.randn(32, 8), torch.randn(32, 1)
        >>> r = amp_step(model, opt, x, y, torch.nn.functional.mse_loss, dtype=torch.bfloat16,
        ...              scaler=LossScaler(), max_grad_norm=1.0)
        >>> r.scale, r.skipped, model[0].weight.dtype       # master weights stay fp32
        (65536.0, False, torch.float32)

    .. warning::
        The backward pass runs *outside* the autocast block (autograd replays each op in the dtype
        its forward used), and clipping happens only after ``scaler.unscale_``. Clipping scaled
        gradients clips by a norm ``scale`` times too large.
    """
    device_type = device_type or inputs.device.type
    _check_autocast_args(device_type, dtype)
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
    if dtype is torch.float16 and scaler is None:
        warnings.warn("amp_step with dtype=torch.float16 and no scaler: small gradients underflow to 0 "
                      "in fp16. Pass scaler=gc.LossScaler() or torch.amp.GradScaler().", stacklevel=2)

    optimizer.zero_grad(set_to_none=True)
    # 1) forward (and the loss) in autocast: matmuls in `dtype`, parameters untouched (fp32)
    with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = loss_fn(model(inputs), targets)
    # 2) backward outside autocast, on the scaled loss (DDP all-reduces gradients in here)
    scale = scaler.get_scale() if scaler is not None else None
    (scaler.scale(loss) if scaler is not None else loss).backward()
    # 3) unscale before anything looks at the gradients, then clip
    grad_norm = None
    if max_grad_norm is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)
        grad_norm = float(nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    # 4) step (skipped on inf/NaN) and 5) update the scale
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler.get_scale() < scale
    else:
        optimizer.step()
        skipped = False
    return AmpStepResult(float(loss.detach()), scale, skipped, grad_norm)


class AutocastModule(nn.Module):
    """Run ``module`` under ``torch.autocast`` *inside* its own ``forward``.

    autocast is a thread-local switch. Anything that calls the model from another thread — the
    replicas of DataParallel run one per device thread — does not see an autocast entered by the
    caller. Entering it inside ``forward`` works wherever ``forward`` runs. (PyTorch's docs do the
    same by decorating ``forward`` with ``@torch.autocast(...)``.)

    Args:
        module: the model to wrap (its parameters stay fp32).
        device_type: ``"cpu"`` or ``"cuda"``.
        dtype: ``torch.bfloat16`` or ``torch.float16``.

    Example::

        >>> import threading, torch
        >>> inner = torch.nn.Linear(4, 4)
        >>> outputs = {}
        >>> def replica(m, name):                       # what a DataParallel worker thread does
        ...     outputs[name] = m(torch.ones(2, 4)).dtype
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     for m, name in ((inner, "outside"), (AutocastModule(inner), "inside")):
        ...         t = threading.Thread(target=replica, args=(m, name)); t.start(); t.join()
        >>> outputs                                      # autocast outside did not reach the thread
        {'outside': torch.float32, 'inside': torch.bfloat16}

    .. warning::
        Old posts say DataParallel "cannot be combined with mixed precision" — that was Apex's
        restriction. With ``torch.autocast`` it works, as long as autocast is entered inside the
        replica's ``forward``. ``torch.nn.DataParallel`` passes only the caller's autocast *on/off*
        state to its threads, not the dtype (that is thread-local too): a caller's bf16 region runs
        the replicas in the device's default, fp16 on CUDA. Hand-made thread pools pass nothing.
    """

    def __init__(self, module: nn.Module, device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        _check_autocast_args(device_type, dtype)
        if dtype is None:
            raise ValueError("dtype must be torch.float16 or torch.bfloat16, got None")
        self.module = module
        self.device_type = device_type
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


@dataclass(frozen=True)
class OpRecord:
    """One call seen under autocast: the function's name, its tensor inputs' dtypes, its output dtype.

    Args:
        name: the torch function's name (``"linear"``).
        input_dtypes: dtypes of its tensor arguments.
        output_dtype: dtype of its result.

    Example::

        >>> import torch
        >>> OpRecord("cross_entropy", (torch.bfloat16, torch.int64), torch.float32).kind
        'fp32'

    .. warning::
        ``kind`` is inferred from dtypes: an op that merely promotes mixed inputs can look like a
        cast made by autocast.
    """

    name: str
    input_dtypes: tuple
    output_dtype: torch.dtype

    @property
    def kind(self) -> str:
        """``"lower precision"``, ``"fp32"`` or ``"follows inputs"``: what autocast made of this op."""
        if self.output_dtype in _LOW and torch.float32 in self.input_dtypes:
            return "lower precision"
        if self.output_dtype == torch.float32 and any(d in _LOW for d in self.input_dtypes):
            return "fp32"
        return "follows inputs"


class _RecordDtypes(TorchFunctionMode):
    """Sees every torch function call (outermost only: nested calls run with the mode disabled)."""

    def __init__(self):
        super().__init__()
        self.records: list[OpRecord] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func))
        ins = tuple(a.dtype for a in list(args) + list((kwargs or {}).values())
                    if isinstance(a, torch.Tensor))
        if isinstance(out, torch.Tensor) and ins and not name.startswith("__"):
            self.records.append(OpRecord(name, ins, out.dtype))
        return out


def autocast_op_dtypes(fn: Callable, *args, device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                       **kwargs) -> list[OpRecord]:
    """Run ``fn(*args, **kwargs)`` under autocast and record the dtypes every torch function produced.

    Args:
        fn: code to inspect, e.g. a model's forward plus its loss.
        device_type, dtype: the autocast region to use.

    Example::

        >>> import torch, torch.nn.functional as F
        >>> x, w, labels = torch.randn(8, 16), torch.randn(4, 16), torch.zeros(8, dtype=torch.long)
        >>> for r in autocast_op_dtypes(lambda: F.cross_entropy(F.linear(x, w), labels)):
        ...     print(r.name, r.output_dtype, r.kind)
        linear torch.bfloat16 lower precision
        cross_entropy torch.float32 fp32

    .. warning::
        The op lists differ by device: CUDA autocast runs e.g. ``softmax``, ``layer_norm`` and
        ``sum`` in fp32, while CPU autocast leaves them in bf16 (its kernels accumulate in fp32
        internally). Check on the device you train on.
    """
    _check_autocast_args(device_type, dtype)
    if dtype is None:
        raise ValueError("dtype must be torch.float16 or torch.bfloat16, got None")
    with torch.autocast(device_type, dtype=dtype), _RecordDtypes() as recorder:
        fn(*args, **kwargs)
    return recorder.records


def _short(dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
            torch.float64: "fp64"}.get(dtype, str(dtype).replace("torch.", ""))


def format_op_table(records: list[OpRecord]) -> str:
    """A printable table of :func:`autocast_op_dtypes` records.

    Args:
        records: what :func:`autocast_op_dtypes` returned.

    Example::

        >>> import torch
        >>> print(format_op_table([OpRecord("linear", (torch.float32, torch.float32), torch.bfloat16)]))
        op      inputs      -> output  autocast
        linear  fp32, fp32  -> bf16    lower precision

    .. warning::
        Only the outermost torch calls are listed; what happens inside ``F.cross_entropy`` (its
        ``log_softmax``) is not shown separately.
    """
    rows = [(r.name, ", ".join(_short(d) for d in r.input_dtypes), _short(r.output_dtype), r.kind)
            for r in records]
    w0 = max([len("op")] + [len(r[0]) for r in rows]) + 2
    w1 = max([len("inputs")] + [len(r[1]) for r in rows]) + 2
    lines = [f"{'op':<{w0}}{'inputs':<{w1}}-> {'output':<7} autocast"]
    lines += [f"{a:<{w0}}{b:<{w1}}-> {c:<7} {d}" for a, b, c, d in rows]
    return "\n".join(lines)
