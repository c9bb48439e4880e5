"""Ring all-reduce from send/recv vs gloo's own ``dist.all_reduce`` (and the naive one), 4 M float32.

Each rank owns 4 M float32 (16 MB). Rounds alternate which implementation goes first (so a slow
moment of the machine hits both alike); each operation starts after a barrier and its time is the
slowest rank's. Throughput ratio = gloo's median time / ours, like for like: the ring without its
shape check (``check_shapes=False``; ``dist.all_reduce`` checks nothing), the checked default
printed beside it. The ceiling, measured in the same run: the ring's 2 (p - 1) chunk-sized
messages alone, without adds or checks (what the transport allows this algorithm).

    python benchmarks/all_reduce.py                  # 2 and 3 ranks; target: ring >= 1.0x gloo
    python benchmarks/all_reduce.py --ranks 2 3 4 --numel 1000000 --segment-bytes 262144
"""

import argparse
import sys

import gpucourse as gc

TARGET = 1.0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    p.add_argument("--numel", type=int, default=4 * 2**20)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--segment-bytes", type=int, default=gc.distributed.collectives.DEFAULT_SEGMENT_BYTES)
    p.add_argument("--no-naive", action="store_true")
    args = p.parse_args(argv)
    mb = args.numel * 4 / 2**20
    impls = ("gloo", "ring", "checked ring", "messages") + (() if args.no_naive else ("naive",))
    all_met = True
    for world_size in args.ranks:
        timings = list(gc.all_reduce_timings(world_size, args.numel, rounds=args.rounds,
                                             implementations=impls,
                                             segment_bytes=args.segment_bytes, timeout=600).values())
        print(f"\n== {world_size} ranks, {args.numel:,} float32 ({mb:.0f} MB) per rank, "
              f"segments of {args.segment_bytes:,} bytes, median of {args.rounds}")
        print(gc.format_comparison(*timings))
        for t in timings:
            print(f"  {t.name:<22} {mb / t.median / 1024:.2f} GB/s algorithm bandwidth")
        gloo, ring, checked, messages = timings[:4]
        ratio = gc.speedup(gloo, ring)
        met = ratio >= TARGET
        all_met &= met
        print(f"ring / gloo throughput at {world_size} ranks: {ratio:.2f}x "
              f"(target >= {TARGET}x): {'MET' if met else 'NOT MET'}; the ring runs at "
              f"{messages.median / ring.median:.0%} of its ceiling here (its messages alone, no adds: "
              f"{messages.median * 1e3:.1f} ms)")
        print(f"  with its shape check (the default; dist.all_reduce has none): {gc.speedup(gloo, checked):.2f}x "
              f"gloo's speed, the check costing {(checked.median - ring.median) * 1e3:+.1f} ms")
    return 0 if all_met else 1


if __name__ == "__main__":
    sys.exit(main())
