"""Time ``all_reduce`` of several sizes across the processes of a job; rank 0 prints one JSON line.

Run it across machines to see what your network does to data-parallel training:

    # two machines, one process each (only --node_rank differs)
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=1 --master_addr=10.0.0.1 --master_port=29500 scripts/allreduce_bench.py
    torchrun --nnodes=2 --node_rank=1 --nproc_per_node=1 --master_addr=10.0.0.1 --master_port=29500 scripts/allreduce_bench.py

Output: ``{"world_size": 2, "backend": "gloo", "sizes": [...bytes], "seconds": [...median]}``.
Compare with ``gc.ring_all_reduce_time`` (chapter 05). ``benchmarks/multi_node_1gbe.py`` runs it
over an emulated 1 Gbit/s link.
"""

import argparse
import datetime
import json
import statistics
import time

import torch
import torch.distributed as dist

import gpucourse as gc


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1 << 10, 1 << 20, 4 << 20, 16 << 20], help="bytes, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    env = gc.dist_env_from()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    seconds = []
    for nbytes in args.sizes:
        buf = torch.ones(max(nbytes // 4, 1))        # fp32: nbytes / 4 elements
        dist.all_reduce(buf)                         # warm-up (connections, buffers)
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - start)
        t = torch.tensor([statistics.median(times)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)    # the slowest rank decides
        seconds.append(t.item())
    if env.rank == 0:
        print(json.dumps({"world_size": env.world_size, "backend": "gloo", "sizes": args.sizes,
                          "seconds": seconds}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
