"""Train ``gc.TinyGPT`` split over the parallel axes and report what each rank holds — the run that
checks chapter 12's planner.

Every rank prints one JSON line: its coordinates, the bytes of parameters, gradients, optimizer
state and saved activations it holds (counted by chapter 08's ``gc.measure_step_memory`` on one
micro-batch) and the median time of a training step::

    python scripts/train_nd.py --nprocs 8 --dp 4 --tp 2 --zero 1 --microbatches 2
    torchrun --standalone --nproc_per_node=8 scripts/train_nd.py --dp 4 --tp 2 --zero 1

Axes in this version: data parallel (``--dp``, with ``--zero 0|1|2`` from chapter 08's
``gc.ZeroOptimizer``), tensor parallel (``--tp``, chapter 09's ``gc.tensor_parallel_gpt``, no
sequence parallelism), micro-batches (gradient accumulation) and ``--recompute none|full``
(each block checkpointed). ``--pp``, ``--cp``, ``--ep`` and ZeRO-3 wait for chapters 10 and 11's
pipeline-of-TinyGPT, ring attention and expert parallel to land (see the chapter 12 issue); the
flags exist and say so. Mesh order: tp innermost (neighbouring ranks), then dp.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import gpucourse as gc


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for axis in ("dp", "tp", "pp", "cp", "ep"):
        p.add_argument(f"--{axis}", type=int, default=1)
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--nprocs", type=int, default=0, help="start the ranks with gc.launch instead of torchrun")
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    world = a.dp * a.tp * a.pp * a.cp * a.ep
    if a.pp > 1 or a.cp > 1 or a.ep > 1 or a.zero == 3 or a.recompute == "selective":
        p.error("--pp, --cp, --ep, --zero 3 and --recompute selective need chapters 10-11 merged "
                "(not in this version of train_nd.py)")
    if a.global_batch % (a.dp * a.microbatches):
        p.error(f"--global-batch {a.global_batch} must divide by dp × microbatches = {a.dp * a.microbatches}")
    if a.nprocs and a.nprocs != world:
        p.error(f"--nprocs {a.nprocs} but dp·tp·pp·cp·ep = {world}")
    return a


class AllReduceOptimizer:
    """Plain data parallelism (ZeRO-0): average the gradients over ``group``, then step."""

    def __init__(self, params, optim, group):
        self.params, self.group = list(params), group
        self.optim = optim
        self.param_groups = optim.param_groups

    def step(self):
        n = dist.get_world_size(self.group)
        flat = torch.cat([p.grad.flatten() for p in self.params]).contiguous()
        dist.all_reduce(flat, group=self.group)
        flat /= n
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.optim.step()

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad(set_to_none=set_to_none)


class LossOf(torch.nn.Module):
    """``forward(idx)`` returns the model's loss on ``self.targets`` (for ``gc.measure_step_memory``)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.targets = model, None

    def forward(self, idx):
        return self.model.loss(idx, self.targets)


def checkpoint_blocks(model):
    """Full recomputation: each block keeps only its input; its forward runs again in the backward."""
    if isinstance(model, gc.TinyGPT):
        for block in model.blocks:
            inner = block.forward
            block.forward = lambda x, inner=inner: checkpoint(inner, x, use_reentrant=False)
        return

    def block_fn(b):                       # a TensorParallelGPT block (its forward is inlined in the model's)
        def run(x):
            x = x + b.attn(b.ln1(x))
            return x + b.mlp(b.ln2(x))
        return run

    def forward(idx):                      # TensorParallelGPT.forward with every block checkpointed
        T = idx.shape[1]
        x = model.tok_emb(idx) + model.pos_emb(torch.arange(T, device=idx.device))
        for b in model.blocks:
            x = checkpoint(block_fn(b), x, use_reentrant=False)
        x = gc.copy_to_tensor_parallel(model.ln_f(x), model.group, label="head")
        return torch.nn.functional.linear(x, model.tok_emb.weight)

    model.forward = forward


def worker(rank, world_size, a):
    torch.set_num_threads(a.threads)
    tp_groups = [dist.new_group(list(range(d * a.tp, (d + 1) * a.tp))) for d in range(a.dp)]
    dp_groups = [dist.new_group(list(range(t, world_size, a.tp))) for t in range(a.tp)]
    tp_rank, dp_rank = rank % a.tp, rank // a.tp
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    cfg = dict(vocab_size=a.vocab, seq_len=a.seq, num_layers=a.layers, hidden=a.hidden, num_heads=a.heads)
    torch.manual_seed(0)
    model = gc.TinyGPT(**cfg)
    if a.tp > 1:
        model = gc.tensor_parallel_gpt(model, tp_group)
    if a.recompute == "full":
        checkpoint_blocks(model)
    if a.zero and a.dp > 1:
        opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=a.zero, group=dp_group, lr=1e-3)
    elif a.dp > 1:
        opt = AllReduceOptimizer(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-3), dp_group)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro = a.global_batch // a.dp // a.microbatches
    g = torch.Generator().manual_seed(1000 + dp_rank)                   # tp ranks share their batch
    batches = [torch.randint(0, a.vocab, (a.microbatches, micro, a.seq), generator=g) for _ in range(2)]

    wrapped = LossOf(model)
    wrapped.targets = batches[0][0]
    memory = gc.measure_step_memory(wrapped, opt, batches[0][0], batches[0][0], loss_fn=lambda out, target: out)

    times = []
    for step in range(a.steps + 1):
        x = batches[step % 2]
        dist.barrier()
        start = time.perf_counter()
        for m in range(a.microbatches):
            (model.loss(x[m], x[m]) / a.microbatches).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        t = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)                          # a step ends when the slowest rank ends
        if step:
            times.append(t.item())
    return {"rank": rank, "dp": a.dp, "tp": a.tp, "pp": a.pp, "cp": a.cp, "ep": a.ep, "zero": a.zero,
            "microbatches": a.microbatches, "recompute": a.recompute, "params": memory.parameters,
            "grads": memory.gradients, "optimizer": memory.optimizer_state, "activations": memory.activations,
            "step_time": statistics.median(times)}


def main(argv=None):
    a = parse(argv)
    if a.nprocs:
        for line in gc.launch(worker, a.nprocs, args=(a,), timeout=a.timeout):
            print(json.dumps(line), flush=True)
        return 0
    dist.init_process_group("gloo")
    try:
        print(json.dumps(worker(dist.get_rank(), dist.get_world_size(), a)), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
