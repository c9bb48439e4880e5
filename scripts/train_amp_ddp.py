"""Mixed-precision DDP training of the seeds' CIFAR-10 ``Net`` — the seed's Apex script, today.

The seed article trains with NVIDIA Apex::

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    model = apex.parallel.DistributedDataParallel(model)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()

Apex's ``amp`` and its DDP are deprecated. This script does the same with PyTorch alone:
``torch.autocast`` for the forward pass, ``torch.amp.GradScaler`` for fp16 (bf16 needs none), and
native ``DistributedDataParallel`` — one process per device, one scaler per process.

    # one machine, 2 processes: CPU processes with gloo (bf16), or 2 GPUs with NCCL
    torchrun --standalone --nproc_per_node=2 scripts/train_amp_ddp.py --epochs 1
    torchrun --standalone --nproc_per_node=8 scripts/train_amp_ddp.py --amp fp16   # GPUs, fp16 + scaler

    # several nodes: as in scripts/train_ddp.py (chapter 05), e.g. --nnodes=2 --node_rank=... --master_addr=...

``--amp auto`` picks bf16 where it is supported (CPUs; Ampere and newer GPUs) and fp16 + GradScaler
on older GPUs. Data: real CIFAR-10 under ``--data`` if present (never downloaded), else
``gc.SyntheticCIFAR10``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms

try:
    import gpucourse as gc
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import gpucourse as gc

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=100, help="per process, as in the seed")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--data", default="data", help="folder with cifar-10-batches-py (optional)")
    p.add_argument("--size", type=int, default=None, help="synthetic dataset size (default 5000)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke tests)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # 1) who am I? torchrun sets these; without torchrun: a world of one process
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(gc.free_port()))
    # one GPU per process on this machine, else gloo on the CPU (gc.default_backend says why)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    use_cuda = gc.default_backend(local_world, say=rank == 0) == "nccl"
    if use_cuda:
        torch.cuda.set_device(local_rank)      # before any CUDA work: this process owns one GPU
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))

    # 2) precision: bf16 where supported, else fp16 with a loss scaler
    amp = args.amp
    if amp == "auto":
        amp = "bf16" if (not use_cuda or torch.cuda.is_bf16_supported()) else "fp16"
    dtype = DTYPES[amp]
    scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)   # one per process

    # 3) model (fp32 master weights, untouched by autocast), DDP, optimizer — in this order
    torch.manual_seed(0)
    model = DDP(gc.Net().to(device), device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # 4) data: every rank reads its own shard
    transform = transforms.Compose([transforms.ToTensor(),
                                    transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))])
    dataset = gc.cifar10_or_synthetic(args.data, train=True, transform=transform, size=args.size,
                                      verbose=rank == 0)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, pin_memory=use_cuda)
    gc.print0(f"{world_size} process(es) on {device.type}, autocast {amp}, loss scaling "
              f"{'on' if scaler.is_enabled() else 'off'}, global batch {args.batch_size * world_size}")

    start, step, loss = time.perf_counter(), 0, torch.zeros(())
    for epoch in range(args.epochs):
        if args.max_steps and step >= args.max_steps:
            break
        sampler.set_epoch(epoch)                                   # a new shuffle every epoch
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = F.cross_entropy(model(images), labels)      # forward in low precision
            scaler.scale(loss).backward()                          # DDP all-reduces in here
            scaler.unscale_(optimizer)                             # true gradients before clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scaler.step(optimizer)                                 # skipped on inf/NaN
            scaler.update()
            step += 1
            if step % 20 == 0:
                gc.print0(f"epoch {epoch + 1} step {step}: loss {loss.item():.4f}, scale {scaler.get_scale():g}")
            if args.max_steps and step >= args.max_steps:
                break
    gc.print0(f"Training complete in {time.perf_counter() - start:.1f} s: {step} steps, last loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    gc.runtime.run_main(main)   # no interpreter teardown: see gpucourse/runtime/exiting.py
