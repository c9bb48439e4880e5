"""Where did the step's time go? A ``torch.profiler`` trace of DDP steps, read back and drawn.

``torch.profiler`` writes a Chrome trace (JSON, open it in ``chrome://tracing`` or Perfetto): one
``"X"`` event per operator with its thread, start ``ts`` and duration ``dur`` in microseconds.
Three kinds of events tell the story of a DDP step:

1) ``autograd::engine::evaluate_function: …`` on the training thread — **backward** computing;
2) ``c10d::allreduce_`` on the same thread — DDP **launching** a bucket's all-reduce (from a
   gradient hook, in the middle of backward);
3) ``gloo:all_reduce`` (``nccl:all_reduce`` on GPUs) on the backend's own threads — the collective
   **in flight** until it ends; with ``record_shapes=True`` it carries the tensor's shape and dtype,
   i.e. the bytes sent.

:func:`step_traces` turns each profiled step into the course's :class:`~gpucourse.StepTrace`
(the same record ``MiniDDP(trace=True)`` keeps in chapter 04), :func:`trace_timeline` draws it with
:func:`~gpucourse.plot_step_trace`, and :func:`allreduce_overlap` measures the share of all-reduce
time hidden under backward — per bucket: an all-reduce in flight [launched, finished) is hidden for
the part of it that lies inside the backward window [first backward op, last backward op).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from ..distributed import StepTrace, plot_step_trace
from ..runtime import check_int, check_type

__all__ = [
    "BucketOverlap",
    "OverlapReport",
    "allreduce_overlap",
    "hidden_fraction",
    "read_trace_events",
    "step_traces",
    "trace_timeline",
]

_BACKWARD = "autograd::engine::evaluate_function"
_LAUNCH = "c10d::allreduce_"
_COLLECTIVE = re.compile(r"^(gloo|nccl):all_?reduce$")
_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "int": 4, "long int": 8,
          "signed char": 1, "unsigned char": 1, "bool": 1, "short int": 2}


def read_trace_events(trace_path: str | os.PathLike) -> list[dict]:
    """The complete (``"ph": "X"``) events of a Chrome trace written by ``prof.export_chrome_trace``.

    Args:
        trace_path: the ``.json`` file.

    Returns:
        dicts with ``name``, ``tid``, ``ts`` and ``dur`` (µs) and ``args``, sorted by start.

    Example::

        >>> import json, os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "t.json")
        >>> _ = open(path, "w").write(json.dumps({"traceEvents": [
        ...     {"ph": "X", "name": "b", "tid": 1, "ts": 5.0, "dur": 1.0},
        ...     {"ph": "i", "name": "marker", "tid": 1, "ts": 0.0},
        ...     {"ph": "X", "name": "a", "tid": 1, "ts": 2.0, "dur": 1.0}]}))
        >>> [e["name"] for e in read_trace_events(path)]
        ['a', 'b']

    .. warning::
        ``ts`` values of different processes come from their own clocks' offsets; compare times
        within one rank's trace, not across ranks.
    """
    check_type("trace_path", trace_path, (str, os.PathLike), "a path to a .json trace")
    if not os.path.exists(trace_path):
        raise FileNotFoundError(f"no profiler trace at {os.fspath(trace_path)!r}; write one with "
                                "prof.export_chrome_trace(path)")
    with open(trace_path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    events = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    return sorted(events, key=lambda e: float(e["ts"]))


def _nbytes(event: dict) -> int:
    args = event.get("args", {})
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not dims or not types:
        return 0                         # profiled without record_shapes=True
    numel = 1
    for d in dims[0]:
        numel *= int(d)
    return numel * _BYTES.get(types[0], 4)


def step_traces(trace_path: str | os.PathLike) -> list[StepTrace]:
    """One :class:`~gpucourse.StepTrace` per profiled step (times in seconds on the trace's clock).

    Steps are the ``ProfilerStep#N`` spans that ``prof.step()`` marks; a trace without them is one
    step. Inside a step: backward runs from the first to the last autograd engine event (an event
    in which DDP's hook launched an all-reduce counts until that launch); the k-th
    all-reduce launch (``c10d::allreduce_``) is paired with the k-th collective event, which gives
    its end and its bytes (``record_shapes=True``; else 0).

    Args:
        trace_path: a Chrome trace of DDP training steps.

    Returns:
        the steps with a backward pass, in order.

    Example::

        >>> import json, os, tempfile
        >>> X = lambda name, tid, ts, dur: {"ph": "X", "name": name, "tid": tid, "ts": ts, "dur": dur}
        >>> events = [X("ProfilerStep#0", 1, 0, 100), X(_BACKWARD + ": AddmmBackward0", 1, 10, 10),
        ...           X(_LAUNCH, 1, 20, 1), X(_BACKWARD + ": MmBackward0", 1, 21, 39),
        ...           X("gloo:all_reduce", 2, 21, 59)]
        >>> path = os.path.join(tempfile.mkdtemp(), "t.json")
        >>> _ = open(path, "w").write(json.dumps({"traceEvents": events}))
        >>> t = step_traces(path)[0]
        >>> round(t.backward_start * 1e6), round(t.backward_end * 1e6), [(c[0], round(c[3] * 1e6)) for c in t.comms]
        (10, 60, [('bucket 0', 80)])

    .. warning::
        The first DDP iteration builds its buckets from the order gradients arrived in; profile
        steps *after* one or two warm-up iterations, or the buckets you see are not the ones used.
    """
    events = read_trace_events(trace_path)
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        steps = [(events[0]["ts"], max(e["ts"] + e["dur"] for e in events))] if events else []
    traces = []
    for lo, hi in steps:
        inside = [e for e in events if lo <= e["ts"] < hi]
        backward = [e for e in inside if e["name"].startswith(_BACKWARD)]
        if not backward:
            continue
        launches = [e for e in inside if e["name"] == _LAUNCH]
        flights = [e for e in inside if _COLLECTIVE.match(e["name"])]
        ends = []
        for e in backward:   # DDP's gradient hook runs inside the autograd op that made the gradient:
            end = e["ts"] + e["dur"]                        # its compute ended where a launch began
            inner = [x["ts"] for x in launches if e["ts"] <= x["ts"] < end]
            ends.append(min(inner) if inner else end)
        trace = StepTrace(backward_start=backward[0]["ts"] * 1e-6, backward_end=max(ends) * 1e-6)
        for k, flight in enumerate(flights):
            launched = launches[k]["ts"] if k < len(launches) else flight["ts"]
            trace.comms.append((f"bucket {k}", _nbytes(flight), launched * 1e-6,
                                (flight["ts"] + flight["dur"]) * 1e-6))
        trace.synced = max([trace.backward_end] + [c[3] for c in trace.comms])
        traces.append(trace)
    return traces


def hidden_fraction(trace: StepTrace) -> float:
    """Share of the all-reduce time of one step spent while backward was still computing.

    Each all-reduce counts from its launch to its end; the part inside
    [``backward_start``, ``backward_end``) is hidden. 1.0: communication fully overlapped;
    0.0: every all-reduce ran after backward (one huge bucket).

    Args:
        trace: a :class:`~gpucourse.StepTrace` with at least one all-reduce.

    Example::

        >>> import gpucourse as gc
        >>> t = gc.StepTrace(backward_start=0.0, backward_end=10.0, synced=14.0,
        ...                  comms=[("bucket 0", 0, 4.0, 8.0), ("bucket 1", 0, 10.0, 14.0)])
        >>> hidden_fraction(t)          # 4 of the 8 seconds in flight were under backward
        0.5

    .. warning::
        On a CPU, gloo's threads compete with backward for the same cores: "hidden" means *in flight
        at the same time*, not *for free*. On a GPU, NCCL runs on its own stream and the overlap is real.
    """
    check_type("trace", trace, StepTrace)
    if not trace.comms:
        raise ValueError("trace has no all-reduce (trace.comms is empty): nothing to hide")
    total = hidden = 0.0
    for _, _, launched, finished in trace.comms:
        total += finished - launched
        hidden += max(0.0, min(finished, trace.backward_end) - max(launched, trace.backward_start))
    return hidden / total if total > 0 else 0.0


@dataclass(frozen=True)
class BucketOverlap:
    """One bucket's all-reduce, averaged over the profiled steps: bytes, seconds in flight, hidden."""

    label: str
    nbytes: int
    in_flight: float
    hidden: float

    @property
    def fraction(self) -> float:
        return self.hidden / self.in_flight if self.in_flight > 0 else 0.0


@dataclass(frozen=True)
class OverlapReport:
    """What :func:`allreduce_overlap` found in one rank's trace."""

    buckets: list[BucketOverlap]
    backward: float          # seconds of backward per step (mean)
    steps: int

    @property
    def hidden_fraction(self) -> float:
        total = sum(b.in_flight for b in self.buckets)
        return sum(b.hidden for b in self.buckets) / total if total > 0 else 0.0

    @property
    def bytes_per_step(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def __str__(self) -> str:
        rows = [f"{b.label:>9}: {b.nbytes / 2**20:6.2f} MB, in flight {b.in_flight * 1e3:6.1f} ms, "
                f"hidden {b.fraction:4.0%}" for b in self.buckets]
        return "\n".join(rows + [(f"   total: hidden {self.hidden_fraction:.0%} of the all-reduce time "
                                 f"(backward {self.backward * 1e3:.1f} ms, {self.steps} steps)")])


def allreduce_overlap(trace_path: str | os.PathLike, *, skip: int = 0) -> OverlapReport:
    """Per bucket: bytes all-reduced, time in flight and the part hidden under backward.

    Args:
        trace_path: one rank's Chrome trace of DDP steps (``record_shapes=True`` for the bytes).
        skip: leading profiled steps to leave out (warm-up).

    Returns:
        an :class:`OverlapReport`; ``.hidden_fraction`` weights the buckets by their time in flight.

    Example::

        >>> import json, os, tempfile
        >>> X = lambda name, tid, ts, dur: {"ph": "X", "name": name, "tid": tid, "ts": ts, "dur": dur}
        >>> events = [X(_BACKWARD + ": MmBackward0", 1, 0, 50), X(_LAUNCH, 1, 50, 1),
        ...           X(_BACKWARD + ": MmBackward0", 1, 51, 49), X("gloo:all_reduce", 2, 50, 100)]
        >>> path = os.path.join(tempfile.mkdtemp(), "t.json")
        >>> _ = open(path, "w").write(json.dumps({"traceEvents": events}))
        >>> allreduce_overlap(path).hidden_fraction          # in flight 50..150, backward until 100
        0.5

    .. warning::
        The fraction comes from *one* rank's clock. A rank that waits in the all-reduce for a slower
        peer shows a long all-reduce; measure every rank and look at the slowest.
    """
    skip = check_int("skip", skip, 0)
    traces = [t for t in step_traces(trace_path) if t.comms][skip:]
    if not traces:
        raise ValueError(f"{os.fspath(trace_path)!r} has no DDP step with an all-reduce after skipping "
                         f"{skip}; profile backward of a DDP model (world size ≥ 2)")
    n = len(traces)
    buckets = []
    for k in range(max(len(t.comms) for t in traces)):
        rows = [(t, t.comms[k]) for t in traces if k < len(t.comms)]
        flight = sum(c[3] - c[2] for _, c in rows) / n
        hidden = sum(max(0.0, min(c[3], t.backward_end) - max(c[2], t.backward_start))
                     for t, c in rows) / n
        buckets.append(BucketOverlap(f"bucket {k}", rows[0][1][1], flight, hidden))
    backward = sum(t.backward_end - t.backward_start for t in traces) / n
    return OverlapReport(buckets, backward, n)


def trace_timeline(trace_path, *, step: int = -1, axes=None, title: str | None = None):
    """Draw a profiled DDP step as the course's timeline: backward on top, each bucket below.

    Args:
        trace_path: one rank's Chrome trace, or a list of them (one row of the figure per rank).
        step: which profiled step (``-1``: the last).
        axes: matplotlib ``Axes`` (one per trace) to draw into; default: a new figure.
        title: the figure's title.

    Returns:
        the list of ``Axes``.

    Example::

        >>> import json, os, tempfile, matplotlib
        >>> matplotlib.use("Agg")
        >>> X = lambda name, tid, ts, dur: {"ph": "X", "name": name, "tid": tid, "ts": ts, "dur": dur}
        >>> events = [X(_BACKWARD + ": MmBackward0", 1, 0, 100), X(_LAUNCH, 1, 50, 1),
        ...           X("gloo:all_reduce", 2, 50, 100)]
        >>> path = os.path.join(tempfile.mkdtemp(), "t.json")
        >>> _ = open(path, "w").write(json.dumps({"traceEvents": events}))
        >>> [label.get_text() for label in trace_timeline(path)[0].get_yticklabels()]
        ['bucket 0, 0 B', 'backward']

    .. warning::
        Each rank is drawn on its own clock, from its own backward start: the rows of two ranks
        line up in *duration*, not in absolute time.
    """
    import matplotlib.pyplot as plt

    paths = list(trace_path) if isinstance(trace_path, (list, tuple)) else [trace_path]
    check_int("step", step, None)
    traces = []
    for path in paths:
        steps = step_traces(path)
        if not steps:
            raise ValueError(f"{os.fspath(path)!r} holds no backward pass to draw")
        if not -len(steps) <= step < len(steps):
            raise ValueError(f"step must be in [{-len(steps)}, {len(steps) - 1}] for {os.fspath(path)!r}, "
                             f"got {step}")
        traces.append(steps[step])
    if axes is None:
        rows = sum(len(t.comms) + 1 for t in traces)
        _, axes = plt.subplots(len(traces), 1, figsize=(8, 0.9 * len(traces) + 0.3 * rows), squeeze=False)
        axes = list(axes[:, 0])
    for i, (t, ax) in enumerate(zip(traces, axes)):
        plot_step_trace(t, ax=ax, title=f"rank {i}" if len(traces) > 1 else None)
    if title:
        axes[0].figure.suptitle(title)
        axes[0].figure.tight_layout()
    return axes
