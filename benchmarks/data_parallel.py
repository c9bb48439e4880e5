"""DataParallel over 2 CPU virtual devices vs one thread: small conv nets, and a tiny model that loses.

One training step = forward, cross-entropy, backward, with batch 64. The baseline runs the model on
the whole batch in one thread (``torch.set_num_threads(1)``); ``gc.DataParallel`` runs two replicas
on two virtual devices — two worker threads with one intra-op thread each — so the comparison is
1 core vs 2 cores. Both compute the same gradients (checked below).

    python benchmarks/data_parallel.py     # targets: >= 1.5x for the small conv net on 2 cores, and
                                           # >= 90% of the bare threads' speed measured beside it

The exit status is non-zero when the target is NOT MET (after everything is printed).

Printed for each model:

* ``1 thread`` — the baseline; ``DataParallel x2`` — ``gc.DataParallel`` over ``cpu:0, cpu:1``;
* ``bare threads x2`` — two threads that each run a private copy of the model on half the batch
  (forward + backward, no scatter/replicate/gather, no shared autograd graph): the ceiling that
  this machine allows for that model, whatever DataParallel does.

The target is measured on ``gc.SmallConvNet`` (the seeds' CIFAR network with 32/64 channels
instead of 6/16, 0.26 M parameters) — the same model lessons 02 and 03 measure. The seeds' own ``gc.Net`` (62 k parameters) is reported too: its ops
are so small that half a batch costs well over half the time of a whole one, which caps any
2-device speed-up. The tiny model (``gc.ToyModel``, 10 → 10 → 5) shows the other side: its whole
step costs less than DataParallel's fixed per-step work, so two devices are slower than one.
Timings interleave the variants in rounds so that a slow moment of the machine hits all of them.
"""

import copy
import sys

import torch
import torch.nn.functional as F

import gpucourse as gc
from gpucourse.data_parallel.device_workers import run_on_devices
from gpucourse.runtime.timing import Timing

BATCH = 64
TARGET = 1.5
CEILING_SHARE = 0.90      # DataParallel's speed as a share of the bare threads' (the same run's ceiling)


def interleaved(fns: dict, rounds: int, repeats: int) -> dict:
    """``gc.measure`` every function ``repeats`` times per round, alternating; all times pooled."""
    timings = {name: Timing(name) for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            timings[name].times += gc.measure(fn, repeats=repeats, warmup=1, name=name).times
    return timings


def compare(label, make_model, x, y, devices, rounds, repeats):
    torch.manual_seed(0)
    model = make_model()
    twin = copy.deepcopy(model)
    dp = gc.DataParallel(twin, device_ids=devices)

    # the same computation: one step each from the same weights gives the same gradients
    for m in (model, dp):
        F.cross_entropy(m(x), y).backward()
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), twin.parameters()))

    copies = [copy.deepcopy(model) for _ in devices]
    halves = list(zip(x.chunk(len(devices)), y.chunk(len(devices))))

    def bare_half(i):
        xi, yi = halves[i]
        return torch.autograd.grad(F.cross_entropy(copies[i](xi), yi), list(copies[i].parameters()))

    fns = {
        f"{label}: 1 thread": lambda: F.cross_entropy(model(x), y).backward(),
        f"{label}: DataParallel x{len(devices)}": lambda: F.cross_entropy(dp(x), y).backward(),
        f"{label}: bare threads x{len(devices)}": lambda: run_on_devices(
            bare_half, [(i,) for i in range(len(devices))], devices),
    }
    timings = list(interleaved(fns, rounds, repeats).values())
    with gc.record_timeline() as timeline:
        F.cross_entropy(dp(x), y).backward()
    return timings, diff, timeline


def report(label, timings, diff, timeline):
    single, parallel, bare = timings
    print(gc.format_comparison(single, parallel, bare))
    print(f"  max |grad difference| DataParallel vs 1 thread: {diff:.1e}")
    for name in ("forward", "backward"):
        spans = [e - s for _, lab, s, e in timeline.spans if lab == name]
        print(f"  {name}: both devices busy together {timeline.overlap(name) * 1e3:.2f} ms "
              f"of {sum(spans) / len(spans) * 1e3:.2f} ms per device")
    return gc.speedup(single, parallel), gc.speedup(bare, parallel)


def main() -> int:
    torch.set_num_threads(1)                   # the baseline: one core
    devices = [torch.device("cpu", 0), torch.device("cpu", 1)]
    print(f"{gc.cpu_cores()} usable cores; virtual devices {[str(d) for d in devices]}; batch {BATCH}\n")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)

    ratio, share = report("gc.SmallConvNet",
                          *compare("gc.SmallConvNet", gc.SmallConvNet, x, y, devices, rounds=5, repeats=6))
    met = ratio >= TARGET and share >= CEILING_SHARE
    print(f"small conv net: DataParallel on 2 virtual devices is {ratio:.2f}x one thread (target >= {TARGET}x), "
          f"{share:.0%} of the bare-thread ceiling measured beside it (target >= {CEILING_SHARE:.0%}): "
          f"{'MET' if met else 'NOT MET'}\n")

    net_ratio, _ = report("gc.Net", *compare("gc.Net", gc.Net, x, y, devices, rounds=5, repeats=8))
    print(f"the seeds' gc.Net: {net_ratio:.2f}x (for reference; the bare-threads row is this model's ceiling)\n")

    xt = torch.randn(BATCH, 10, generator=g)
    yt = torch.randint(0, 5, (BATCH,), generator=g)
    (t_single, t_parallel, _), _, _ = compare("ToyModel", gc.ToyModel, xt, yt, devices,
                                              rounds=5, repeats=20)
    print(gc.format_comparison(t_single, t_parallel))
    overhead = t_parallel.median - t_single.median / 2
    print(f"tiny model: DataParallel is {gc.speedup(t_single, t_parallel):.2f}x one thread — it loses.")
    print(f"  why: the whole step takes {t_single.median * 1e6:.0f} µs on one thread, so splitting it could "
          f"save at most {t_single.median / 2 * 1e6:.0f} µs, but DataParallel adds about {overhead * 1e6:.0f} µs "
          "per step: replicating the model, two hand-offs to the device threads in forward and two in "
          "backward, and Python glue that holds the GIL.")
    return 0 if met else 1                        # non-zero exit: a target is NOT MET


if __name__ == "__main__":
    sys.exit(main())
