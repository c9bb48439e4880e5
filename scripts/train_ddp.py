"""Train the seeds' CIFAR-10 ``Net`` with DistributedDataParallel — one process per device.

The script form of chapter 04: what you run on a real GPU box or cluster. Each process reads who it
is from the variables torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), trains on its own shard of the data, and rank 0 prints and saves checkpoints.

    # one machine, 2 processes (CPU processes with gloo, or 2 GPUs with NCCL)
    torchrun --standalone --nproc_per_node=2 scripts/train_ddp.py --epochs 2

    # two machines ("nodes") with 8 GPUs each: the same command on both, only --node_rank differs
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 \
        scripts/train_ddp.py
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500 \
        scripts/train_ddp.py

    # no torchrun at all: a world of one process (handy for a quick check)
    python scripts/train_ddp.py --epochs 1

You may read (old posts, seed articles) ``python -m torch.distributed.launch --nproc_per_node=N
main.py`` with an ``argparse`` ``--local_rank`` argument — today that launcher is deprecated;
torchrun puts the local rank in the ``LOCAL_RANK`` environment variable instead, as read below.

Data: real CIFAR-10 if it is under ``--data`` (never downloaded), else ``gc.SyntheticCIFAR10``.
The effective (global) batch is ``--batch-size × WORLD_SIZE``: with 2 nodes × 8 GPUs and 32 per
process it is 32 × 8 × 2 = 512.

A run never hangs forever: ``--time-limit`` stops training (all ranks agree on when, so no rank
is left alone in a collective), and a watchdog dumps every thread's stack and exits if a rank is
stuck for ``--time-limit`` + 120 s.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

try:
    import gpucourse as gc
except ImportError:  # run from a checkout without `pip install -e .`: use the checkout's package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import gpucourse as gc


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per process (global = this × WORLD_SIZE)")
    p.add_argument("--lr", type=float, default=0.02,
                   help="SGD learning rate (scale it with the global batch: linear scaling rule)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--size", type=int, default=5000, help="SyntheticCIFAR10 training images")
    p.add_argument("--data", default="data", help="folder holding real CIFAR-10 (optional)")
    p.add_argument("--backend", default=None, help="gloo, nccl or mpi (default: nccl on GPUs, else gloo)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=None, help="save a checkpoint here after every epoch (rank 0)")
    p.add_argument("--resume", action="store_true", help="start from --checkpoint if it exists")
    p.add_argument("--time-limit", type=float, default=600.0,
                   help="seconds of training after which every rank stops at the same step")
    p.add_argument("--log-json", default=None, help="rank 0 writes losses and results here")
    p.add_argument("--no-augment", action="store_true", help="skip RandomCrop/RandomHorizontalFlip")
    p.add_argument("--quiet", action="store_true", help="print only rank 0's final summary")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.time_limit > 0:
        p.error(f"--time-limit must be > 0 seconds, got {args.time_limit}")
    return args


def setup_distributed(backend: str | None, timeout_s: float):
    """Join the process group described by torchrun's variables; returns (rank, local_rank, world, device).

    1) read RANK / LOCAL_RANK / WORLD_SIZE (torchrun, or a world of one without it);
    2) on GPUs: torch.cuda.set_device(LOCAL_RANK) *before* anything touches CUDA, so each process
       owns one device (without it every process lands on cuda:0);
    3) init_process_group with env:// (MASTER_ADDR / MASTER_PORT) and a timeout, so a missing peer
       fails instead of hanging.
    """
    if "WORLD_SIZE" not in os.environ:  # plain `python train_ddp.py`: a world of one process
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    # one GPU per process on this machine (every rank decides alike), else gloo on the CPU
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if backend is None:
        backend = gc.default_backend(local_world, say=rank == 0)
    elif backend == "nccl" and gc.default_backend(local_world, say=False) != "nccl":
        raise SystemExit(f"--backend nccl needs one CUDA GPU per process: LOCAL_WORLD_SIZE={local_world}, "
                         f"{torch.cuda.device_count()} GPU(s) visible; leave --backend out to use gloo")
    use_cuda = backend == "nccl"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return rank, local_rank, world_size, device


def make_loaders(args, rank, world_size):
    from torchvision import transforms

    normalize = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))
    augment = [] if args.no_augment else [transforms.RandomCrop(32, padding=4),
                                          transforms.RandomHorizontalFlip()]
    train_tf = transforms.Compose([*augment, transforms.ToTensor(), normalize])
    test_tf = transforms.Compose([transforms.ToTensor(), normalize])
    train_set = gc.cifar10_or_synthetic(args.data, train=True, transform=train_tf, size=args.size,
                                        seed=args.seed, verbose=(rank == 0 and not args.quiet))
    test_set = gc.cifar10_or_synthetic(args.data, train=False, transform=test_tf,
                                       size=max(args.size // 5, 1), seed=args.seed, verbose=False)
    # every rank sees a different 1/world_size of the data; the sampler shuffles (not the loader)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=torch.cuda.is_available())
    # evaluation: rank 0 alone on the whole test set (the seed article reused the *train* sampler
    # for its test loader — a bug: it evaluated on training indices)
    test_loader = DataLoader(test_set, batch_size=256, shuffle=False, num_workers=args.workers)
    return sampler, train_loader, test_loader


@torch.no_grad()
def evaluate(model, loader, device) -> float:
    model.eval()
    correct = total = 0
    for images, labels in loader:
        logits = model(images.to(device))
        correct += (logits.argmax(1).cpu() == labels).sum().item()
        total += labels.numel()
    model.train()
    return correct / total


def main(argv=None) -> dict:
    args = parse_args(argv)
    # a watchdog: if this process is stuck (a peer died mid-collective, …) dump stacks and exit
    faulthandler.dump_traceback_later(args.time_limit + 120, exit=True)
    rank, local_rank, world_size, device = setup_distributed(args.backend, args.time_limit + 60)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    say = (lambda *a: None) if args.quiet else gc.print0
    say(f"world_size={world_size} backend={dist.get_backend()} device={device} "
        f"global batch={args.batch_size} x {world_size} = {args.batch_size * world_size}")
    if not args.quiet:
        gc.print_ordered(f"local_rank {local_rank} on host {socket.gethostname()}, device {device}")

    torch.manual_seed(args.seed)
    model = gc.Net().to(device)  # move to the device *before* wrapping
    ddp_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=args.momentum)
    start_epoch = 0
    if args.resume and args.checkpoint and os.path.exists(args.checkpoint):
        # map_location: tensors saved from rank 0's cuda:0 land on *this* rank's device
        # (gc.load_checkpoint: torch.load with weights_only=True — a checkpoint is data, not code)
        state = gc.load_checkpoint(args.checkpoint, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
        say(f"resumed from {args.checkpoint} at epoch {start_epoch}")

    sampler, train_loader, test_loader = make_loaders(args, rank, world_size)
    losses: list[float] = []
    started = time.monotonic()
    stopped_early = False
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch (without it: the same order every epoch)
        epoch_losses = []
        for images, labels in train_loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = F.cross_entropy(ddp_model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces (averages) the gradients here, bucket by bucket
            optimizer.step()
            epoch_losses.append(loss.detach())
            # every rank must stop at the same step: every 10 steps rank 0's clock decides for all
            if (len(losses) + len(epoch_losses)) % 10 == 0:
                stop = torch.tensor([float(time.monotonic() - started > args.time_limit)], device=device)
                dist.broadcast(stop, src=0)
                if stop.item():
                    stopped_early = True
                    break
        # the loss of every step, averaged over the ranks: one collective per epoch, not per step
        epoch_mean = torch.stack(epoch_losses)
        dist.all_reduce(epoch_mean)
        losses += (epoch_mean / world_size).tolist()
        say(f"epoch {epoch + 1}/{args.epochs}: mean loss of the last 20 steps "
                  f"{sum(losses[-20:]) / len(losses[-20:]):.4f}")
        if args.checkpoint:
            # every rank calls it: rank 0 writes atomically (temp file, fsync, rename), the others
            # wait until the file is complete — and all stop at once if rank 0's save fails
            gc.save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "epoch": epoch}, args.checkpoint)
        if stopped_early:
            say(f"time limit of {args.time_limit:g} s reached: stopping")
            break

    result = {"world_size": world_size, "steps": len(losses), "losses": losses,
              "seconds": time.monotonic() - started, "stopped_early": stopped_early}
    if rank == 0:
        result["test_accuracy"] = evaluate(model, test_loader, device)
        print(f"trained {len(losses)} steps in {result['seconds']:.1f} s; "
              f"test accuracy {result['test_accuracy']:.3f}", flush=True)
        if args.log_json:
            with open(args.log_json, "w") as f:
                json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return result


def spawn_entry(gpu, nodes, gpus, nr, master_addr, master_port, argv=None):
    """The seed article's launch: ``mp.spawn(spawn_entry, args=(...), nprocs=gpus)`` on every node.

    ``torch.multiprocessing.spawn`` calls it with the process index ``gpu`` first; the rest is what
    torchrun would compute: ``rank = nr * gpus + gpu`` (node rank × processes per node + local
    rank) and ``world_size = nodes * gpus`` — the number of *processes*, not of machines.
    """
    os.environ.update(RANK=str(nr * gpus + gpu), LOCAL_RANK=str(gpu), WORLD_SIZE=str(nodes * gpus),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    return main(argv)


if __name__ == "__main__":
    gc.runtime.run_main(main)   # no interpreter teardown: see gpucourse/runtime/exiting.py
