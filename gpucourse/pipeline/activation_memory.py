"""Activation memory: how many bytes autograd keeps alive for the backward pass.

Training needs, besides weights, gradients and optimizer state, the *activations* that the forward
saves for the backward (a Linear layer keeps its input, a ReLU its output, …). They live from a
micro-batch's forward until its backward — which is why a pipeline schedule's "in-flight
micro-batches" are its activation memory.

:class:`SavedActivationMeter` counts them for real with ``torch.autograd.graph.saved_tensors_hooks``:
every tensor autograd saves is reported to the meter when saved and when released, so ``current``
and ``peak`` are measured bytes, not an estimate. Tensors saved twice (the same storage) count once.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["SavedActivationMeter"]


class _Saved:
    """What autograd stores instead of the tensor; its finalizer tells the meter it was released."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedActivationMeter:
    """Measure the bytes of tensors that autograd saves for backward, while the context is active.

    Example::

        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 1))
        >>> with SavedActivationMeter(ignore=model.parameters()) as meter:
        ...     loss = model(torch.randn(32, 100)).sum()
        ...     held = meter.current
        ...     loss.backward()                          # backward frees the saved tensors
        >>> held == 2 * 32 * 100 * 4     # the input of Linear 1; ReLU's output = Linear 2's input
        True
        >>> meter.current, meter.peak == held
        (0, True)

    Args:
        ignore: tensors not to count although autograd saves them — pass ``model.parameters()``:
            a Linear layer saves its weight for the backward, but the weight is not an activation.

    .. warning::
        Only tensors saved *inside* the ``with`` block are counted. Release of a saved tensor is
        seen when autograd frees its graph (after ``backward``, or when the output is deleted):
        keeping a reference to an output keeps its activations alive.
    """

    def __init__(self, ignore=()):
        self.current = 0
        self.peak = 0
        self._ignore = {t.untyped_storage().data_ptr() for t in ignore}
        self._refs: dict[int, list] = {}   # storage pointer -> [bytes, number of saves alive]
        self._hooks = None

    def _pack(self, tensor: torch.Tensor):
        key = tensor.untyped_storage().data_ptr()
        if key in self._ignore:
            return tensor
        entry = self._refs.get(key)
        if entry is None:
            entry = self._refs[key] = [tensor.untyped_storage().nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        saved = _Saved(tensor)
        weakref.finalize(saved, self._release, key)
        return saved

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._refs[key]

    @staticmethod
    def _unpack(saved) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def __enter__(self) -> "SavedActivationMeter":
        if self._hooks is not None:
            raise RuntimeError("this SavedActivationMeter is already active; use a new one per block")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
