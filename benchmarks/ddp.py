"""DDP on 2 processes × 1 thread vs 1 process × 1 thread, same global batch (the seeds' CIFAR ``Net``).

Both sides train the same model on the same global batch: one process computes all of it; with
DDP two processes compute half each and all-reduce the gradients. Every process uses one thread
(``torch.set_num_threads(1)``, like torchrun's ``OMP_NUM_THREADS=1``), so the ratio shows what a
second worker buys once communication is paid; "2 processes, no communication" (each trains
its half alone) is the ceiling this machine allows. Also shown: ``gc.MiniDDP`` (this course's
wrapper, with and without buckets) on the same job, and — where ``gc.DataParallel`` exists —
DataParallel with two virtual devices (threads in one process) on the same model and batch.

    python benchmarks/ddp.py                     # target: DDP >= 1.6x one process
    python benchmarks/ddp.py --global-batch 256 --steps 5
"""

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gpucourse as gc

TARGET = 1.6


def _batch(global_batch, world_size, rank):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(global_batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (global_batch,), generator=g)
    per = global_batch // world_size
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _trainer(model, x, y, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def run():
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

    return run


def _worker(rank, world_size, global_batch, steps, rounds, with_dp):
    """Every configuration once per round, in rotating order; each time is the slowest rank's.

    The baseline runs on rank 0 alone (the whole global batch, no DDP) while rank 1 waits in a
    barrier, which costs no CPU: it is one process with one thread.
    """
    torch.manual_seed(0)
    full_x, full_y = _batch(global_batch, 1, 0)
    x, y = _batch(global_batch, world_size, rank)
    runs = {
        "1 process x 1 thread": _trainer(gc.Net(), full_x, full_y, steps) if rank == 0 else None,
        "2 processes, no communication": _trainer(gc.Net(), x, y, steps),   # the ceiling
        "torch DDP, 2 processes": _trainer(DDP(gc.Net()), x, y, steps),
        "gc.MiniDDP no buckets, 2 processes": _trainer(gc.MiniDDP(gc.Net()), x, y, steps),
        "gc.MiniDDP buckets, 2 processes": _trainer(gc.MiniDDP(gc.Net(), bucket_cap_mb=25), x, y, steps),
    }
    if with_dp:
        dp = gc.DataParallel(gc.Net(), device_ids=gc.virtual_devices(2))
        runs["gc.DataParallel, 2 virtual devices"] = (_trainer(dp, full_x, full_y, steps)
                                                      if rank == 0 else None)
    names = list(runs)
    for name in names:                                       # warm-up
        if runs[name] is not None:
            runs[name]()
        dist.barrier()
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            if runs[name] is not None:
                runs[name]()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="training steps per timed repeat")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    with_dp = hasattr(gc, "DataParallel")
    times = gc.launch(_worker, 2, args=(args.global_batch, args.steps, args.repeats, with_dp),
                      timeout=900)[0]
    timings = [gc.Timing(name, t) for name, t in times.items()]
    single, ceiling, ddp = timings[0], timings[1], timings[2]
    print(f"gc.Net, {args.steps} steps per repeat, global batch {args.global_batch}, "
          f"median of {args.repeats} (rounds interleaved):")
    print(gc.format_comparison(*timings))
    images = args.global_batch * args.steps
    print(f"images/s: 1 process {images / single.median:.0f}, DDP {images / ddp.median:.0f}")
    ratio = gc.speedup(single, ddp)
    met = ratio >= TARGET
    print(f"2 processes without any communication reach {gc.speedup(single, ceiling):.2f}x on this "
          f"machine: DDP gets {ratio / gc.speedup(single, ceiling):.0%} of that ceiling")
    print(f"DDP 2x1 thread vs 1x1 thread, same global batch: {ratio:.2f}x "
          f"(target >= {TARGET}x): {'MET' if met else 'NOT MET'}")
    if with_dp:
        dp_ratio = gc.speedup(timings[-1], ddp)
        print(f"DDP vs DataParallel on the same model and batch: {dp_ratio:.2f}x "
              f"(> 1: DDP faster)")
        print("  " + explain_dp_vs_ddp(dp_ratio))
    else:
        print("gc.DataParallel is not available in this checkout: DataParallel comparison skipped")
    return 0 if met else 1


def explain_dp_vs_ddp(ratio: float, close: float = 0.15) -> str:
    """What the measured DDP / DataParallel throughput ratio means (``ratio`` > 1: DDP is faster)."""
    if ratio > 1 + close:
        return ("DDP is clearly faster: its two processes share nothing and each runs its own "
                "Python interpreter, while DataParallel's threads share one GIL (the Python parts "
                "of forward/backward run one at a time) and it re-copies the model to every "
                "device, scatters the inputs and gathers the outputs on device 0 every step; DDP's "
                "only per-step cost is one all-reduce of the gradients. On GPUs the gap grows "
                "(PCIe copies, one thread launching every GPU's kernels, GPU 0 gathering)")
    if ratio < 1 - close:
        return ("DataParallel is faster here: on a CPU its per-step copies (replicate, scatter, "
                "gather of a 62k-parameter model) are cheap RAM copies inside one process and the "
                "conv kernels release the GIL, so the threads really overlap, while DDP pays a "
                "loopback all-reduce between two processes every step. This is a CPU artefact: "
                "on GPUs those copies cross PCIe, one Python thread must launch every GPU's "
                "kernels and GPU 0 gathers everything, which is why DDP is the recommended choice")
    return ("they are close on a CPU: DataParallel's per-step costs (copying a 62k-parameter "
            "model, scatter, gather) are RAM copies here and the conv ops release the GIL, while "
            "DDP pays a loopback all-reduce; on GPUs DataParallel's copies cross PCIe, one thread "
            "launches every GPU's kernels and GPU 0 gathers everything, which is why DDP wins there")

if __name__ == "__main__":
    sys.exit(main())
