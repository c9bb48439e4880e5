"""Ring all-reduce from send/recv vs gloo's own ``dist.all_reduce`` (and the naive one), 4 M float32.

Each rank owns 4 M float32 (16 MB). Rounds alternate which implementation goes first (so a slow
moment of the machine hits both alike); each operation starts after a barrier and its time is the
slowest rank's. Throughput ratio = gloo's median time / ours.

    python benchmarks/all_reduce.py                  # 2 and 3 ranks; target: ring >= 0.8x gloo
    python benchmarks/all_reduce.py --ranks 2 3 4 --numel 1000000 --segment-bytes 262144
"""

import argparse
import time

import torch
import torch.distributed as dist

import gpucourse as gc

TARGET = 0.8


def _time(fn, x):
    y = x.clone()
    dist.barrier()
    start = time.perf_counter()
    fn(y)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)          # the slowest rank decides
    return elapsed.item()


def _bench(rank, world_size, numel, rounds, segment_bytes, with_naive):
    torch.manual_seed(rank)
    x = torch.randn(numel)
    impls = {"gloo dist.all_reduce": dist.all_reduce,
             "gc.ring_all_reduce": lambda t: gc.ring_all_reduce(t, segment_bytes=segment_bytes)}
    if with_naive:
        impls["gc.naive_all_reduce"] = gc.naive_all_reduce
    ref = x.clone()
    dist.all_reduce(ref)
    for fn in impls.values():                                # warm-up, and check the result
        y = x.clone()
        fn(y)
        torch.testing.assert_close(y, ref)
    times = {name: [] for name in impls}
    names = list(impls)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(_time(impls[name], x))
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    p.add_argument("--numel", type=int, default=4 * 2**20)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--segment-bytes", type=int, default=gc.collectives.DEFAULT_SEGMENT_BYTES)
    p.add_argument("--no-naive", action="store_true")
    args = p.parse_args(argv)
    mb = args.numel * 4 / 2**20
    all_met = True
    for world_size in args.ranks:
        times = gc.launch(_bench, world_size, timeout=600,
                          args=(args.numel, args.rounds, args.segment_bytes, not args.no_naive))[0]
        timings = [gc.Timing(name, t) for name, t in times.items()]
        print(f"\n== {world_size} ranks, {args.numel:,} float32 ({mb:.0f} MB) per rank, "
              f"segments of {args.segment_bytes:,} bytes, median of {args.rounds}")
        print(gc.format_comparison(*timings))
        for t in timings:
            print(f"  {t.name:<22} {mb / t.median / 1024:.2f} GB/s algorithm bandwidth")
        ratio = gc.speedup(timings[0], timings[1])
        met = ratio >= TARGET
        all_met &= met
        print(f"ring / gloo throughput at {world_size} ranks: {ratio:.2f}x "
              f"(target >= {TARGET}x): {'MET' if met else 'NOT MET'}")
    return 0 if all_met else 1


if __name__ == "__main__":
    main()
