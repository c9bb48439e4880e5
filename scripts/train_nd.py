"""Train ``gc.TinyGPT`` split over the parallel axes and report what each rank holds — the run that
checks chapter 12's planner.

Every rank prints one JSON line: its coordinates, the bytes of parameters, gradients, optimizer
state and saved activations it holds (counted by chapter 08's ``gc.measure_step_memory`` on one
micro-batch) and the median time of a training step::

    python scripts/train_nd.py --nprocs 8 --dp 4 --tp 2 --zero 1 --microbatches 2
    torchrun --standalone --nproc_per_node=8 scripts/train_nd.py --dp 4 --tp 2 --zero 1

Axes in this version: data parallel (``--dp``, with ``--zero 0|1|2`` from chapter 08's
``gc.ZeroOptimizer``; ``--zero 3`` from its ``gc.FullyShardedModule``, with dp and micro-batches
only), tensor parallel (``--tp``, chapter 09's ``gc.tensor_parallel_gpt``, no
sequence parallelism), pipeline parallel (``--pp``, chapter 07's ``gc.pipeline_step`` with 1F1B,
combined with dp; stages cut by ``gc.stage_layers``), micro-batches (pipeline chunks, or gradient
accumulation without pp) and ``--recompute none|full`` (each block checkpointed). ``--cp``,
``--ep`` and pp × tp wait for chapters 10 and 11's 3-D capstone, ring attention and expert
parallel to land (see the chapter 12 issue); the flags exist and say so. Mesh order: tp innermost
(neighbouring ranks), then dp, then pp.
"""

from __future__ import annotations

import argparse
import json
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
    if a.cp > 1 or a.ep > 1 or a.recompute == "selective" or (a.pp > 1 and a.tp > 1):
        p.error("--cp, --ep, --recompute selective and --pp with --tp need chapters 10-11 merged "
                "(not in this version of train_nd.py)")
    if a.zero == 3 and (a.tp > 1 or a.pp > 1 or a.recompute != "none"):
        p.error("--zero 3 (chapter 08's gc.FullyShardedModule over dp) runs with --dp and --microbatches "
                "only")
    if a.pp > a.layers:
        p.error(f"--pp {a.pp} is more stages than --layers {a.layers}")
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

    def __init__(self, model, loss=None):
        super().__init__()
        self.model, self.targets = model, None
        self.loss = loss or model.loss

    def forward(self, idx):
        return self.loss(idx, self.targets)


def checkpoint_blocks(model):
    """Full recomputation: each block keeps only its input; its forward runs again in the backward."""
    if not isinstance(model, gc.TensorParallelGPT):     # TinyGPT or a pipeline Stage: blocks are called
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


class Stage(torch.nn.Module):
    """Pipeline stage ``s`` of a TinyGPT: (embedding) + its blocks (+ final norm and tied head — a copy
    of the embedding on the last stage, as Megatron-LM keeps one; its gradient is not synchronised here)."""

    def __init__(self, model, s, pp):
        super().__init__()
        counts = gc.stage_layers(len(model.blocks), pp)
        start = sum(counts[:s])
        self.first, self.last = s == 0, s == pp - 1
        self.blocks = torch.nn.ModuleList(model.blocks[start:start + counts[s]])
        if self.first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        if self.last:
            self.ln_f, self.head = model.ln_f, torch.nn.Parameter(model.tok_emb.weight.detach().clone())

    def forward(self, x):
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1]))
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.linear(self.ln_f(x), self.head) if self.last else x


def _state_bytes(tensors):
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())


def pipeline_worker(rank, world_size, a):
    """dp × pp (pp outermost): 1F1B over ``a.microbatches``, gradients reduced over dp after the step."""
    torch.set_num_threads(a.threads)
    per = a.dp
    dp_groups = [dist.new_group(list(range(p * per, (p + 1) * per))) for p in range(a.pp)]
    pp_rank, dp_rank = rank // per, rank % per
    cfg = dict(vocab_size=a.vocab, seq_len=a.seq, num_layers=a.layers, hidden=a.hidden, num_heads=a.heads)
    torch.manual_seed(0)
    stage = Stage(gc.TinyGPT(**cfg), pp_rank, a.pp)
    if a.recompute == "full":
        checkpoint_blocks(stage)
    params = list(stage.parameters())
    if a.zero and a.dp > 1:
        opt = gc.ZeroOptimizer(params, torch.optim.AdamW, stage=a.zero, group=dp_groups[pp_rank], lr=1e-3)
    elif a.dp > 1:
        opt = AllReduceOptimizer(params, torch.optim.AdamW(params, lr=1e-3), dp_groups[pp_rank])
    else:
        opt = torch.optim.AdamW(params, lr=1e-3)
    comm = gc.PipelineComm(ranks=[p * per + dp_rank for p in range(a.pp)])
    schedule = gc.make_schedule("1f1b", a.pp, a.microbatches)
    local = a.global_batch // a.dp
    g = torch.Generator().manual_seed(1000 + dp_rank)
    x = torch.randint(0, a.vocab, (local, a.seq), generator=g)
    shape = (a.seq, a.hidden)

    def loss_fn(logits, t):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten())

    times, peak = [], 0
    for step in range(a.steps + 1):
        dist.barrier()
        start = time.perf_counter()
        out = gc.pipeline_step(stage, schedule, comm, batch_size=local, in_shape=shape, out_shape=shape,
                               inputs=x if comm.is_first else None, targets=x if comm.is_last else None,
                               loss_fn=loss_fn, check_neighbours=step == 0, measure_activations=step == 0)
        opt.step()
        if step == 0:
            peak = out["peak_activation_bytes"]
            grads = _state_bytes([p.grad for p in params if p.grad is not None])
            state = getattr(opt, "optim", opt).state
            optimizer_bytes = _state_bytes([v for s in state.values() for v in s.values() if torch.is_tensor(v)])
            param_bytes = _state_bytes(params + [p for gr in opt.param_groups for p in gr["params"]])
        opt.zero_grad(set_to_none=False)
        t = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if step:
            times.append(t.item())
    comm.wait()
    return {"rank": rank, "dp": a.dp, "tp": a.tp, "pp": a.pp, "cp": a.cp, "ep": a.ep, "stage": pp_rank,
            "zero": a.zero, "microbatches": a.microbatches, "recompute": a.recompute, "params": param_bytes,
            "grads": grads, "optimizer": optimizer_bytes, "activations": peak, "step_time": statistics.median(times)}


def worker(rank, world_size, a):
    if a.pp > 1:
        return pipeline_worker(rank, world_size, a)
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
    loss_of = model.loss
    if a.zero == 3 and a.dp > 1:          # ZeRO-3: every layer sharded over dp, the tied tok_emb gathered
        model = gc.FullyShardedModule(model, group=dp_group)

        def loss_of(idx, targets):        # TinyGPT.loss, called through the sharded wrapper
            return torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif a.zero and a.dp > 1:
        opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=a.zero, group=dp_group, lr=1e-3)
    elif a.dp > 1:
        opt = AllReduceOptimizer(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-3), dp_group)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro = a.global_batch // a.dp // a.microbatches
    g = torch.Generator().manual_seed(1000 + dp_rank)                   # tp ranks share their batch
    batches = [torch.randint(0, a.vocab, (a.microbatches, micro, a.seq), generator=g) for _ in range(2)]

    wrapped = LossOf(model, loss_of)
    wrapped.targets = batches[0][0]
    memory = gc.measure_step_memory(wrapped, opt, batches[0][0], batches[0][0], loss_fn=lambda out, target: out)

    times = []
    for step in range(a.steps + 1):
        x = batches[step % 2]
        dist.barrier()
        start = time.perf_counter()
        for m in range(a.microbatches):
            (loss_of(x[m], x[m]) / a.microbatches).backward()
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
