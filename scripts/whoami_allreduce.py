"""Who am I in the job? Print each process's place, then prove the process group works.

Every process reads its rank, local rank, world size and master address from whatever launcher
started it (torchrun, SLURM's srun, or OpenPAI as in the seeds) with ``gc.dist_env_from``, joins
the group through ``env://`` and all-reduces ``rank + 1``: every rank must get
``1 + 2 + … + world_size``.

    # one machine, 2 processes
    torchrun --standalone --nproc_per_node=2 scripts/whoami_allreduce.py

    # two machines with 8 GPUs each: the same command on both, only --node_rank differs
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=10.0.0.1 --master_port=29500 scripts/whoami_allreduce.py
    torchrun --nnodes=2 --node_rank=1 --nproc_per_node=8 --master_addr=10.0.0.1 --master_port=29500 scripts/whoami_allreduce.py

    # SLURM: srun starts one process per task and sets SLURM_PROCID, SLURM_LOCALID, ...
    srun --nodes=2 --ntasks-per-node=8 python scripts/whoami_allreduce.py

    # OpenPAI, the seeds' recipe: one command per node; the script spawns one process per GPU
    python scripts/whoami_allreduce.py --spawn 8

    # all of them emulated on one host: see gc.launch_nodes (chapter 05)
"""

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gpucourse as gc


def run(local_rank, args):
    """One process: find my place, join the group, all-reduce, leave."""
    spawned = args.spawn is not None
    env = gc.dist_env_from(local_rank=local_rank if spawned else None,
                           nproc_per_node=args.spawn if spawned else None)
    os.environ.update(env.to_environ())                      # what env:// reads
    # one GPU per process on this machine, else gloo on the CPU (gc.default_backend says why)
    use_cuda = gc.default_backend(env.nproc_per_node, say=env.local_rank == 0) == "nccl"
    if use_cuda:
        torch.cuda.set_device(env.local_rank)                # one GPU per process
    dist.init_process_group("nccl" if use_cuda else "gloo",  # init_method="env://" is the default
                            timeout=datetime.timedelta(seconds=args.timeout))
    t = torch.tensor([env.rank + 1.0], device="cuda" if use_cuda else "cpu")
    dist.all_reduce(t)
    expected = env.world_size * (env.world_size + 1) / 2
    # mp.spawn's children share one terminal: label lines like torchrun's --tee does
    label = f"[rank {env.rank}] " if spawned else ""
    line = (f"{label}rank {env.rank:>2} = node {env.node_rank} x {env.nproc_per_node} + local "
            f"{env.local_rank}  of world_size {env.world_size}  ({env.source}, master "
            f"{env.master_addr})  all_reduce: {t.item():g} {'✓' if t.item() == expected else '✗'}")
    sys.stdout.write(line + "\n")  # one write: lines of processes sharing a terminal stay whole
    sys.stdout.flush()
    dist.destroy_process_group()
    if t.item() != expected:
        raise SystemExit(f"rank {env.rank}: all_reduce gave {t.item()}, expected {expected}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spawn", type=int, default=None, metavar="K",
                        help="start K processes on this node with mp.spawn (OpenPAI / the seeds' "
                             "recipe); by default the launcher started this process")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="process-group timeout in seconds")
    args = parser.parse_args()
    if args.spawn is None:
        run(None, args)
    else:
        mp.spawn(run, args=(args,), nprocs=args.spawn, join=True)


if __name__ == "__main__":
    main()
