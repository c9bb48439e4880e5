"""Start-up cost of a 2-rank job: `gc.launch` (fork) vs `torch.multiprocessing.spawn`.

Each run is the whole life of a tiny distributed job: start 2 processes, join a gloo process
group on loopback, one all-reduce, tear down. `spawn` starts fresh interpreters that re-import
torch (seconds); `launch` forks the running interpreter, which already has torch loaded.

    python benchmarks/launch.py            # target: launch < 1.5 s and >= 3x faster than spawn
"""

import os
import sys

import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))

import gpucourse as gc  # noqa: E402
from _bench_targets import launch_entry, spawn_entry  # noqa: E402


def run_spawn():
    os.environ["BENCH_PORT"] = str(gc.free_port())
    mp.spawn(spawn_entry, args=(2,), nprocs=2, join=True)


def run_launch():
    assert gc.launch(launch_entry, 2) == [2.0, 2.0]


def main():
    t_spawn = gc.measure(run_spawn, repeats=3, warmup=1, name="torch.multiprocessing.spawn")
    t_launch = gc.measure(run_launch, repeats=5, warmup=1, name="gpucourse.launch (fork)")
    print(gc.format_comparison(t_spawn, t_launch))
    ratio = gc.speedup(t_spawn, t_launch)
    ok = t_launch.median < 1.5 and ratio >= 3
    print(f"launch: {t_launch.median:.3f} s per 2-rank job, {ratio:.1f}x faster than spawn "
          f"(target < 1.5 s and >= 3x): {'MET' if ok else 'NOT MET'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
