"""Elastic DDP training that survives a crashed rank: checkpoint every k steps, resume on restart.

``torchrun --max-restarts=N`` restarts *every* process of the job when one dies. This script then
finds its latest checkpoint and continues bit-identically: model, optimizer, loss-scaler state,
the sampler's epoch and position, and every rank's RNG states are restored
(``gc.save_training_state`` / ``gc.load_training_state``).

    # an uninterrupted run, then one where rank 1 dies at step 7 and torchrun restarts the job
    torchrun --standalone --nproc_per_node=2 scripts/train_elastic.py --checkpoint-dir /tmp/a
    torchrun --standalone --nproc_per_node=2 --max-restarts=1 scripts/train_elastic.py \\
        --checkpoint-dir /tmp/b --crash-at-step 7
    # both print the same last line:  final loss L param-checksum C

``--crash-at-step K``: rank 1 raises an error when it is about to run step K — only on the first
attempt (it leaves a marker file ``crashed-once`` in the checkpoint folder). The model is the seeds'
CIFAR-10 ``Net`` on ``gc.SyntheticCIFAR10`` (offline), with a random horizontal flip per sample so
that the RNG state matters.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

try:
    import gpucourse as gc
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import gpucourse as gc

MARKER = "crashed-once"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in total")
    p.add_argument("--checkpoint-dir", required=True, help="where step_<N>.pt checkpoints go")
    p.add_argument("--checkpoint-every", type=int, default=5, help="save every k steps")
    p.add_argument("--crash-at-step", type=int, default=None, help="rank 1 fails once, before step K")
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--size", type=int, default=256, help="synthetic training samples")
    args = p.parse_args(argv)
    for name in ("steps", "checkpoint_every", "batch_size", "size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def param_checksum(model: torch.nn.Module) -> str:
    """A hash of every parameter's bytes: equal only if the runs are bit-identical."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv=None):
    args = parse_args(argv)
    # 1) who am I (torchrun's variables), and the group
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(gc.free_port()))
    # every attempt under its own key prefix: a restarted rank must never read the *dead* attempt's
    # gloo addresses from torchrun's store (seen as "connectFullMesh failed: Connection refused")
    timeout = datetime.timedelta(seconds=60)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"   # torchrun hosts the store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_store, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"train_elastic/attempt_{attempt}", store),
                            rank=rank, world_size=world_size, timeout=timeout)
    torch.set_num_threads(1)

    # 2) everything the next step depends on — built the same way on every (re)start
    torch.manual_seed(0)
    model = DDP(gc.Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = gc.LossScaler(init_scale=2.0**8, growth_interval=3)     # its scale changes as we train
    images, labels = gc.SyntheticCIFAR10(size=args.size).tensors()
    dataset = TensorDataset((images - 0.5) / 0.25, labels)
    sampler = gc.ResumableSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    # its own generator: every new DataLoader iterator draws a seed from the *global* RNG otherwise,
    # and the resumed run (a new iterator mid-epoch) would draw one more than the uninterrupted one
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        generator=torch.Generator().manual_seed(0))

    # 3) resume from the latest checkpoint, if any (a restart after a crash)
    step = 0
    latest = gc.latest_checkpoint(args.checkpoint_dir)
    if latest is not None:
        step = gc.load_training_state(latest, model=model, optimizer=optimizer, sampler=sampler,
                                      scaler=scaler)
        gc.print0(f"resumed from {os.path.basename(latest)}: step {step}, epoch {sampler.epoch}, "
                  f"position {sampler.position}, loss scale {scaler.get_scale():g}")
    else:
        sampler.set_epoch(0)

    # 4) train; checkpoint every k steps
    loss = torch.zeros(())
    while step < args.steps:
        for x, y in loader:
            if step == args.crash_at_step and rank == 1:
                marker = os.path.join(args.checkpoint_dir, MARKER)
                if not os.path.exists(marker):
                    os.makedirs(args.checkpoint_dir, exist_ok=True)
                    open(marker, "w").close()
                    raise RuntimeError(f"rank 1: simulated failure before step {step} (first attempt)")
            flip = torch.rand(x.shape[0], 1, 1, 1) < 0.5                # augmentation: uses the RNG
            x = torch.where(flip, x.flip(3), x)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()                              # DDP all-reduces in here
            scaler.step(optimizer)
            scaler.update()
            sampler.advance(x.shape[0])
            step += 1
            if step % args.checkpoint_every == 0:
                gc.save_training_state(os.path.join(args.checkpoint_dir, f"step_{step}.pt"), model=model,
                                       optimizer=optimizer, step=step, sampler=sampler, scaler=scaler)
            if step >= args.steps:
                break
        else:                                                           # the epoch is used up
            sampler.set_epoch(sampler.epoch + 1)

    gc.print0(f"final loss {loss.item():.6f} param-checksum {param_checksum(model)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    gc.runtime.run_main(main)   # no interpreter teardown: see gpucourse/runtime/exiting.py
