"""Instrumentation of a pipeline step: when each computation ran, how many micro-batches were alive,
and how many bytes autograd saved — kept out of :func:`~gpucourse.pipeline_step`'s schedule loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from .activation_memory import SavedActivationMeter
from .schedule import TimelineEvent

__all__ = ["StepRecorder", "synced"]


def synced(clock: Callable[[], float], device: torch.device) -> float:
    """Read the clock after the device has finished its queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock()


class StepRecorder:
    """Records one stage's step: a :class:`TimelineEvent` per computation, the peak number of
    micro-batches in flight, and (optionally) the peak bytes saved for backward.

    Args:
        stage_index: the stage (a row of the timeline).
        clock: time source (``time.perf_counter``: shared by processes on one machine).
        device: the stage's device (CUDA is synchronised before reading the clock).
        module: the stage's module when activation bytes are measured (its parameters are not
            counted), or ``None`` to skip the meter (its hook costs a few per cent of compute).

    Example::

        >>> import time
        >>> rec = StepRecorder(0, time.perf_counter, torch.device("cpu"), None)
        >>> with rec:
        ...     with rec.compute("F", 0):
        ...         _ = torch.ones(3) * 2
        ...     rec.alive(1)
        >>> [(e.kind, e.microbatch) for e in rec.events], rec.peak_in_flight, rec.peak_activation_bytes
        ([('F', 0)], 1, None)
    """

    def __init__(self, stage_index: int, clock: Callable[[], float], device: torch.device,
                 module: nn.Module | None):
        self.stage, self.clock, self.device = stage_index, clock, device
        self.events: list[TimelineEvent] = []
        self.peak_in_flight = 0
        self._meter = SavedActivationMeter(ignore=module.parameters()) if module is not None else None

    def __enter__(self) -> "StepRecorder":
        if self._meter is not None:
            self._meter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._meter is not None:
            self._meter.__exit__(*exc)

    @contextlib.contextmanager
    def compute(self, kind: str, microbatch: int):
        """Time the computation inside the ``with`` block as one event of the timeline."""
        start = synced(self.clock, self.device)
        yield
        self.events.append(TimelineEvent(self.stage, kind, microbatch, start,
                                         synced(self.clock, self.device)))

    def alive(self, in_flight: int) -> None:
        """Note how many micro-batches hold saved activations now."""
        self.peak_in_flight = max(self.peak_in_flight, in_flight)

    @property
    def peak_activation_bytes(self) -> int | None:
        return self._meter.peak if self._meter is not None else None
