"""How much of DDP's all-reduce time is hidden under backward: default buckets vs one huge bucket.

Two gloo processes train a 67 MB MLP (four 2048×2048 layers) with ``torch.nn.parallel.DistributedDataParallel``,
once with DDP's default buckets (``bucket_cap_mb=25``, first bucket 1 MB) and once with one bucket
holding every gradient (``bucket_cap_mb=1000``). Each rank records 3 steps with ``torch.profiler``
(``gc.profile_ddp_steps``); ``gc.allreduce_overlap`` reads the share of all-reduce time (launch →
end) that lies inside backward. The number reported per configuration is the **slowest rank's**
(longest backward): a faster rank waits inside its all-reduces for the slower one, and that wait is
not communication.

    python benchmarks/overlap.py            # target: default buckets hide >= 50 %
"""

import argparse
import os
import sys
import tempfile

import torch

import gpucourse as gc

TARGET = 0.50


def _rank(rank, world_size, folder, cap, width, batch):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gc.MLP(width, width, width, width, width, 10)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
    path = os.path.join(folder, f"cap{cap:g}_rank{rank}.json")
    gc.profile_ddp_steps(model, x, y, path, bucket_cap_mb=cap, warmup=2, steps=3)
    report = gc.allreduce_overlap(path)
    return report.backward, report.hidden_fraction, len(report.buckets), report.bytes_per_step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)
    slowest = {}
    with tempfile.TemporaryDirectory(prefix="overlap_") as folder:      # the ranks' profiles
        for name, cap in (("default buckets (25 MB)", 25.0), ("one huge bucket", 1000.0)):
            ranks = gc.launch(_rank, 2, args=(folder, cap, args.width, args.batch), timeout=300)
            for rank, (backward, hidden, buckets, nbytes) in enumerate(ranks):
                print(f"{name:>24}, rank {rank}: {buckets} bucket(s), {nbytes / 2**20:.0f} MB, backward "
                      f"{backward * 1e3:.0f} ms, hidden {hidden:.0%}")
            slowest[name] = max(ranks)[1]                    # the rank with the longest backward
    default, huge = slowest["default buckets (25 MB)"], slowest["one huge bucket"]
    met = default >= TARGET
    print(f"hidden under backward (slowest rank): default {default:.0%}, one huge bucket {huge:.0%}; "
          f"target default >= {TARGET:.0%}: {'MET' if met else 'NOT MET'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
