"""Fault tolerance, measured: elastic restart overhead, bit-identical resume, DCP save+load time.

1) ``scripts/train_elastic.py`` under ``torchrun --standalone --nproc_per_node=2``: 20 steps with a
   checkpoint every 5, uninterrupted, and with rank 1 failing before step ``--crash-at-step``
   (default 12) under ``--max-restarts=1``. The ratio of wall times is the restart's price: the
   steps since the last checkpoint run twice, plus a second start-up (Python, torch, the group).
   Target <= 1.5x. The two runs must print the same ``param-checksum`` (bit-identical resume) — a
   miss there fails the benchmark whatever the times. Printed beside it, the floor measured in the
   same run: one worker started alone (no torchrun) and run for one step — Python, torch, the group,
   the model, the data —, which every restart pays again; (uninterrupted + that) / uninterrupted is
   the least a restart can cost on this machine, whatever torchrun and the checkpoint do — and what
   that start-up is made of: ``import torch`` and ``torch._dynamo``, which torch's DDP and
   optimizers import (measured in fresh interpreters beside it, medians of 3), and the rest.
2) DCP: an MLP sharded with FSDP2 over 1, 2 and 3 ranks saves a checkpoint (model + Adam state)
   and loads it back on as many ranks; the slowest rank's time is reported.

    python benchmarks/fault_tolerance.py                   # targets: <= 1.5x, checksums equal
    python benchmarks/fault_tolerance.py --batch-size 128   # heavier steps: start-up weighs less
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import gpucourse as gc

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.5


def _train_elastic(launcher, folder, steps, every, batch, size, *extra):
    """Run ``scripts/train_elastic.py`` under ``launcher`` (Python's arguments before the script:
    torchrun's, or none for one worker alone); (seconds, its ``final loss`` lines, the run)."""
    cmd = [sys.executable, *launcher, str(ROOT / "scripts" / "train_elastic.py"),
           "--checkpoint-dir", str(folder), "--steps", str(steps), "--checkpoint-every", str(every),
           "--batch-size", str(batch), "--size", str(size), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, check=True)
    final = [line for line in out.stdout.splitlines() if line.startswith("final loss")]
    return time.perf_counter() - start, final, out


def _torchrun(folder, steps, every, batch, size, *extra, restarts=0):
    return _train_elastic(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           f"--max-restarts={restarts}"], folder, steps, every, batch, size, *extra)


def _one_worker_start(folder, batch, size) -> float:
    """Seconds for one worker of ``train_elastic.py`` alone — Python, torch, its group, the model,
    the data, one step — without torchrun: what a restart pays again at the least."""
    return _train_elastic([], folder, 1, 5, batch, size)[0]


def _import_seconds(code: str) -> float:
    """Seconds a fresh interpreter takes to run ``code`` (imports)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   timeout=300)
    return time.perf_counter() - start


def _dcp(rank, world_size, folder, width):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gc.fully_shard_model(gc.MLP(width, width, width, width, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).sum().backward()
    optimizer.step()
    torch.distributed.barrier()
    start = time.perf_counter()
    gc.dcp_save(folder, model, optimizer)
    saved = time.perf_counter() - start
    torch.distributed.barrier()
    start = time.perf_counter()
    gc.dcp_load(folder, model, optimizer)
    return saved, time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--crash-at-step", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=128, help="per process")
    p.add_argument("--width", type=int, default=1024, help="DCP model width (3 layers of width²)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="fault_tolerance_"))
    size = 2 * args.batch_size * 8                              # 8 steps per epoch
    try:
        clean, clean_final, _ = _torchrun(work / "clean", args.steps, args.checkpoint_every,
                                          args.batch_size, size)
        crashed, crashed_final, out = _torchrun(work / "crashed", args.steps, args.checkpoint_every,
                                                args.batch_size, size, "--crash-at-step",
                                                str(args.crash_at_step), restarts=1)
        restarted = "resumed from" in out.stdout
        ratio = crashed / clean
        same = len(clean_final) == 1 and clean_final == crashed_final
        # the floor: a restart starts its workers again (Python, torch, the group, the model) — what
        # one worker alone takes to start and run one step, the median of 3, in the same run
        # and what it is made of, in fresh interpreters beside it (this machine's speed moves): Python,
        # import torch, and torch._dynamo, which torch's DDP constructor and optimizer.step import
        rounds = [(_one_worker_start(work / f"alone{k}", args.batch_size, size), _import_seconds("pass"),
                   _import_seconds("import torch"), _import_seconds("import torch, torch._dynamo"))
                  for k in range(3)]
        start_up, bare, torch_s, dynamo_s = (sorted(column)[1] for column in zip(*rounds))
        floor = (clean + start_up) / clean
        print(f"{args.steps} steps, checkpoint every {args.checkpoint_every}, batch {args.batch_size}/rank: "
              f"uninterrupted {clean:.1f} s, crash before step {args.crash_at_step} + restart "
              f"{crashed:.1f} s ({'restarted' if restarted else 'NO RESTART SEEN'})")
        print(f"one worker alone starts and runs a step in {start_up:.1f} s: a restart cannot cost less than "
              f"(uninterrupted + that) / uninterrupted = {floor:.2f}x on this machine (this run's floor)")
        print(f"restart overhead {ratio:.2f}x (target <= {TARGET}x): {'MET' if ratio <= TARGET else 'NOT MET'}"
              f"; the floor is {floor / ratio:.0%} of it (100%: all of the overhead is starting the workers again)")
        print(f"  of the floor's {start_up:.1f} s: Python {bare:.2f} s, import torch {torch_s - bare:.2f} s, "
              f"torch._dynamo {dynamo_s - torch_s:.2f} s (torch's DistributedDataParallel constructor and "
              f"optimizer.step import it), the rest {start_up - dynamo_s:.2f} s (the group, the model, "
              f"the data, one step): workers that kept torch imported (forked) would put the floor at "
              f"{(clean + start_up - dynamo_s) / clean:.2f}x")
        print(f"checksums: {clean_final[0] if clean_final else '?'} | {crashed_final[0] if crashed_final else '?'}"
              f" -> {'EQUAL' if same else 'DIFFERENT'} (must be equal)")
        params = sum(q.numel() for q in gc.MLP(args.width, args.width, args.width, args.width, 10).parameters())
        print(f"DCP save+load of a {params / 1e6:.1f} M-parameter MLP + Adam state ({params * 12 / 2**20:.0f} MB):")
        for n in (1, 2, 3):
            times = gc.launch(_dcp, n, args=(str(work / f"dcp{n}"), args.width), timeout=300)
            save, load = max(t[0] for t in times), max(t[1] for t in times)
            print(f"  {n} rank(s): save {save * 1e3:6.0f} ms, load {load * 1e3:6.0f} ms")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if (ratio <= TARGET and same and restarted) else 1


if __name__ == "__main__":
    sys.exit(main())
