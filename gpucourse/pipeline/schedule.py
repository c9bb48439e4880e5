"""Pipeline schedules as data: who computes which micro-batch when, and how much sits idle.

A pipeline of ``p`` stages trains on a batch cut into ``m`` micro-batches. Each stage runs a list of
operations — ``F3`` is "forward of micro-batch 3", ``B3`` its backward — in a fixed order. That
order *is* the schedule; everything else follows from it:

1) :func:`gpipe_schedule` — fill–drain: every stage does all ``m`` forwards, then all ``m``
   backwards. Simple, but every stage holds the activations of all ``m`` micro-batches at once.
2) :func:`one_f_one_b_schedule` — 1F1B (PipeDream-flush): after a short warm-up of forwards each
   stage alternates one forward, one backward, so stage ``s`` holds at most ``p - s`` micro-batches.
3) :meth:`PipelineSchedule.simulate` — run the order on an ideal machine (each forward takes
   ``forward_time``, each backward ``backward_time``, an operation starts as soon as its input has
   arrived) and get a :class:`Timeline`: start and end of every operation, the idle share
   ("bubble") of every stage, a text grid and a Gantt chart.

The same :class:`PipelineSchedule` drives the real multi-process pipeline
(:func:`gpucourse.train_pipeline`), and the timestamps measured there form a :class:`Timeline` too,
so the ideal and the measured schedule can be drawn side by side.

For equal stages and no communication cost the bubble of both schedules is
:func:`bubble_fraction` ``= (p - 1) / (m + p - 1)``: more micro-batches, smaller bubble.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence

from ..runtime import check_int

__all__ = ["PipelineOp", "PipelineSchedule", "TimelineEvent", "Timeline", "bubble_fraction",
           "gpipe_schedule", "one_f_one_b_schedule"]


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The ideal share of time a pipeline stage sits idle: ``(p - 1) / (m + p - 1)``.

    Each stage is busy for ``m`` slots out of ``m + p - 1``: the pipeline needs ``p - 1`` slots to
    fill (the last stage waits for the first micro-batch to reach it) and ``p - 1`` to drain.

    Args:
        num_stages: ``p``, the number of pipeline stages (devices).
        num_microbatches: ``m``, how many micro-batches each batch is cut into.

    Example::

        >>> bubble_fraction(4, 1)      # no micro-batching: 3 of 4 devices idle on average
        0.75
        >>> round(bubble_fraction(2, 8), 4)
        0.1111
        >>> bubble_fraction(1, 8)      # one stage never waits
        0.0

    .. warning::
        This is the *ideal*: equal stages, no communication time. A slower stage or slow links make
        the measured bubble larger; only more micro-batches (or interleaved schedules) make it smaller.
    """
    check_int("num_stages", num_stages, 1)
    check_int("num_microbatches", num_microbatches, 1)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


@dataclass(frozen=True)
class PipelineOp:
    """One operation of a stage: ``kind`` ``"F"`` (forward) or ``"B"`` (backward) of a micro-batch.

    Args:
        kind: ``"F"`` or ``"B"``.
        microbatch: the micro-batch index, from 0.

    Example::

        >>> PipelineOp("B", 3)
        B3

    .. warning::
        A stage may run ``B i`` only after its own ``F i``: the backward needs the activations the
        forward saved (:class:`PipelineSchedule` checks this).
    """

    kind: str
    microbatch: int

    def __post_init__(self):
        if self.kind not in ("F", "B"):
            raise ValueError(f"kind must be 'F' or 'B', got {self.kind!r}")
        check_int("microbatch", self.microbatch, 0)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"

    __repr__ = __str__


@dataclass(frozen=True)
class TimelineEvent:
    """When ``stage`` ran operation ``kind`` (``"F"``/``"B"``) of ``microbatch``: ``[start, end)``.

    Args:
        stage, kind, microbatch: which operation.
        start, end: when it computed (seconds, or slots in a simulation).

    Example::

        >>> TimelineEvent(1, "F", 0, 2.0, 3.5).duration
        1.5

    .. warning::
        Measured events cover the computation only; waiting for a message is idle time.
    """

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """Start and end of every pipeline operation — ideal (simulated) or measured.

    Args:
        events: the operations of all stages.
        num_stages: how many stages the pipeline has (stages without events count as idle).
        name: a title for prints and plots.

    Example::

        >>> timeline = gpipe_schedule(2, 2).simulate(forward_time=1, backward_time=2)
        >>> timeline.makespan, timeline.stage_bubbles(), timeline.bubble()   # (p-1)/(m+p-1) = 1/3
        (9.0, [0.33333333333333337, 0.33333333333333337], 0.33333333333333337)

    .. warning::
        :meth:`bubble` averages over stages the idle share of the *whole* span, from the first
        operation to the last; an unbalanced stage shows up as extra bubble in the others.
    """

    events: list[TimelineEvent]
    num_stages: int
    name: str = "timeline"

    @classmethod
    def from_measured(cls, events: Sequence[TimelineEvent], num_stages: int,
                      name: str = "measured") -> "Timeline":
        """Timestamps from several processes, shifted so that the first operation starts at 0."""
        t0 = min(e.start for e in events)
        shifted = [TimelineEvent(e.stage, e.kind, e.microbatch, e.start - t0, e.end - t0)
                   for e in events]
        return cls(sorted(shifted, key=lambda e: (e.stage, e.start)), num_stages, name)

    @property
    def makespan(self) -> float:
        """From the first start to the last end over all stages."""
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self, stage: int) -> float:
        """Total time ``stage`` spent computing."""
        return sum(e.duration for e in self.events if e.stage == stage)

    def stage_bubbles(self) -> list[float]:
        """For each stage, the share of the makespan it was idle."""
        span = self.makespan
        return [1.0 - self.busy(s) / span for s in range(self.num_stages)]

    def overlap(self) -> float:
        """Time during which at least two stages compute at once (0 for a naive model split)."""
        points = sorted({t for e in self.events for t in (e.start, e.end)})
        total = 0.0
        for a, b in zip(points[:-1], points[1:]):
            mid = (a + b) / 2
            if sum(e.start <= mid < e.end for e in self.events) >= 2:
                total += b - a
        return total

    def bubble(self) -> float:
        """The idle share averaged over stages — compare with :func:`bubble_fraction`."""
        bubbles = self.stage_bubbles()
        return sum(bubbles) / len(bubbles)

    def to_text(self, slot: float | None = None) -> str:
        """A grid with one column per ``slot`` of time (default: the shortest operation).

        Each column shows the operation running then, ``..`` when the stage is idle.
        """
        slot = slot or min(e.duration for e in self.events)
        width = max(len(f"{e.kind}{e.microbatch}") for e in self.events)
        columns = round(self.makespan / slot)
        t0 = min(e.start for e in self.events)
        rows = []
        for s in range(self.num_stages):
            cells = ["." * width] * columns
            for e in self.events:
                if e.stage == s:
                    first, last = round((e.start - t0) / slot), round((e.end - t0) / slot)
                    for c in range(first, last):
                        cells[c] = f"{e.kind}{e.microbatch}".ljust(width)
            rows.append(f"stage {s} | " + " ".join(cells))
        return "\n".join(rows)

    def plot(self, ax=None, *, title: str | None = None):
        """A Gantt chart: one row per stage, forwards blue, backwards orange, micro-batch labelled."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(9, 0.5 + 0.6 * self.num_stages))
        colors = {"F": "tab:blue", "B": "tab:orange"}
        t0 = min(e.start for e in self.events)
        for e in self.events:
            ax.barh(e.stage, e.duration, left=e.start - t0, height=0.8, color=colors[e.kind],
                    edgecolor="white", linewidth=0.5)
            if e.duration > 0.02 * self.makespan:
                ax.text(e.start - t0 + e.duration / 2, e.stage, f"{e.kind}{e.microbatch}",
                        ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(self.num_stages), [f"stage {s}" for s in range(self.num_stages)])
        ax.invert_yaxis()
        ax.set_xlim(0, self.makespan)
        ax.set_title(title or f"{self.name}: bubble {self.bubble():.0%}")
        return ax


@dataclass
class PipelineSchedule:
    """The order in which each stage runs its forwards and backwards.

    Args:
        name: e.g. ``"GPipe"``.
        ops: ``ops[s]`` — the operations of stage ``s`` in execution order. Every stage must run
            ``F i`` and ``B i`` exactly once for every micro-batch ``i``, the forward first.

    Use :func:`gpipe_schedule` or :func:`one_f_one_b_schedule` to make one.

    Example::

        >>> sched = one_f_one_b_schedule(2, 4)
        >>> sched.ops[0]
        [F0, F1, B0, F2, B1, F3, B2, B3]
        >>> sched.peak_in_flight()       # micro-batches whose activations a stage holds at once
        [2, 1]
    """

    name: str
    ops: list[list[PipelineOp]] = field(default_factory=list)

    def __post_init__(self):
        if not self.ops:
            raise ValueError("a schedule needs at least one stage")
        m = self.num_microbatches
        for s, stage_ops in enumerate(self.ops):
            seen: set[PipelineOp] = set()
            for op in stage_ops:
                if op in seen:
                    raise ValueError(f"stage {s} runs {op} twice")
                if op.kind == "B" and PipelineOp("F", op.microbatch) not in seen:
                    raise ValueError(f"stage {s} runs {op} before F{op.microbatch}")
                seen.add(op)
            expected = {PipelineOp(k, i) for k in "FB" for i in range(m)}
            if seen != expected:
                missing = sorted(map(str, expected - seen))
                raise ValueError(f"stage {s} must run F and B of micro-batches 0..{m - 1}; "
                                 f"missing {missing}")

    @property
    def num_stages(self) -> int:
        return len(self.ops)

    @property
    def num_microbatches(self) -> int:
        return sum(op.kind == "F" for op in self.ops[0])

    def peak_in_flight(self) -> list[int]:
        """Per stage: the most micro-batches forwarded but not yet backwarded at any moment.

        Each of them keeps its activations alive, so this is the stage's activation memory in units
        of "one micro-batch's activations".
        """
        peaks = []
        for stage_ops in self.ops:
            live = peak = 0
            for op in stage_ops:
                live += 1 if op.kind == "F" else -1
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def simulate(self, forward_time: float = 1.0, backward_time: float = 1.0,
                 comm_time: float = 0.0) -> Timeline:
        """Run the schedule on an ideal machine and return when each operation starts and ends.

        Args:
            forward_time: duration of one stage's forward of one micro-batch.
            backward_time: duration of its backward (about ``2 * forward_time`` in practice).
            comm_time: delay for an activation or gradient to reach the neighbouring stage.

        ``F i`` on stage ``s`` waits for ``F i`` on stage ``s - 1``; ``B i`` waits for ``B i`` on
        stage ``s + 1`` (the last stage's backward only needs its own forward); a stage runs its
        operations one after another in the listed order.

        Example::

            >>> print(gpipe_schedule(2, 3).simulate().to_text())
            stage 0 | F0 F1 F2 .. .. B0 B1 B2
            stage 1 | .. F0 F1 F2 B0 B1 B2 ..
        """
        for name, value in (("forward_time", forward_time), ("backward_time", backward_time)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not comm_time >= 0:
            raise ValueError(f"comm_time must be >= 0, got {comm_time}")
        p = self.num_stages
        done: dict[tuple[int, PipelineOp], float] = {}  # (stage, op) -> end time
        free = [0.0] * p                                  # when each stage is next idle
        nxt = [0] * p                                     # index of each stage's next op
        events: list[TimelineEvent] = []
        while any(nxt[s] < len(self.ops[s]) for s in range(p)):
            progressed = False
            for s in range(p):
                while nxt[s] < len(self.ops[s]):
                    op = self.ops[s][nxt[s]]
                    if op.kind == "F":
                        dep = (s - 1, op) if s > 0 else None
                    else:
                        dep = (s + 1, op) if s < p - 1 else (s, PipelineOp("F", op.microbatch))
                    if dep is not None and dep not in done:
                        break  # waits for a neighbour
                    ready = 0.0 if dep is None else done[dep] + (comm_time if dep[0] != s else 0.0)
                    start = max(free[s], ready)
                    end = start + (forward_time if op.kind == "F" else backward_time)
                    done[(s, op)] = free[s] = end
                    events.append(TimelineEvent(s, op.kind, op.microbatch, start, end))
                    nxt[s] += 1
                    progressed = True
            if not progressed:
                waiting = {s: str(self.ops[s][nxt[s]]) for s in range(p) if nxt[s] < len(self.ops[s])}
                raise ValueError(f"schedule {self.name!r} deadlocks: stages wait forever at {waiting}")
        return Timeline(sorted(events, key=lambda e: (e.stage, e.start)), p, f"{self.name} (ideal)")

    def __str__(self) -> str:
        return "\n".join(f"stage {s}: " + " ".join(map(str, ops)) for s, ops in enumerate(self.ops))


def gpipe_schedule(num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """GPipe's fill–drain schedule: all forwards, then all backwards, on every stage.

    Args:
        num_stages: ``p``.
        num_microbatches: ``m``.

    Example::

        >>> sched = gpipe_schedule(3, 4)
        >>> sched.ops[1]
        [F0, F1, F2, F3, B0, B1, B2, B3]
        >>> sched.peak_in_flight()
        [4, 4, 4]

    .. warning::
        Every stage keeps the activations of all ``m`` micro-batches until the backwards start, so
        activation memory grows with ``m`` — the very knob that shrinks the bubble. 1F1B
        (:func:`one_f_one_b_schedule`) has the same bubble with at most ``p`` micro-batches alive.
    """
    check_int("num_stages", num_stages, 1)
    check_int("num_microbatches", num_microbatches, 1)
    ops = [[PipelineOp("F", i) for i in range(num_microbatches)]
           + [PipelineOp("B", i) for i in range(num_microbatches)] for _ in range(num_stages)]
    return PipelineSchedule("GPipe", ops)


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """1F1B (PipeDream-flush): warm up with forwards, then alternate one forward, one backward.

    Stage ``s`` first runs ``w = min(p - s - 1, m)`` forwards — just enough to keep the stages after
    it busy — then ``m - w`` pairs (forward, backward), then the remaining ``w`` backwards.

    Args:
        num_stages: ``p``.
        num_microbatches: ``m``.

    Example::

        >>> sched = one_f_one_b_schedule(3, 4)
        >>> print(sched)
        stage 0: F0 F1 F2 B0 F3 B1 B2 B3
        stage 1: F0 F1 B0 F2 B1 F3 B2 B3
        stage 2: F0 B0 F1 B1 F2 B2 F3 B3
        >>> sched.peak_in_flight()       # GPipe would keep 4 on every stage
        [3, 2, 1]

    .. warning::
        1F1B saves activation memory, not time: with equal stages its bubble is the same
        ``(p - 1) / (m + p - 1)`` as GPipe's. Interleaved schedules (several stages per device)
        are what shrink the bubble further.
    """
    check_int("num_stages", num_stages, 1)
    check_int("num_microbatches", num_microbatches, 1)
    p, m = num_stages, num_microbatches
    ops = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        stage_ops = [PipelineOp("F", i) for i in range(warmup)]
        for i in range(m - warmup):               # steady state: one forward, one backward
            stage_ops += [PipelineOp("F", warmup + i), PipelineOp("B", i)]
        stage_ops += [PipelineOp("B", i) for i in range(m - warmup, m)]  # cool-down
        ops.append(stage_ops)
    return PipelineSchedule("1F1B", ops)
