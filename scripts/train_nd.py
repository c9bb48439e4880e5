"""Train ``gc.TinyGPT`` split over the parallel axes and report what each rank holds — the run that
checks chapter 12's planner.

Every rank prints one JSON line: its coordinates, the bytes of parameters, gradients, optimizer
state and saved activations it holds (counted by chapter 08's ``gc.measure_step_memory`` on one
micro-batch), the median time of a training step and the global batch's loss at every step (the
same numbers as a less split run with the same seed: the split changes where the work runs, not
what is computed)::

    python scripts/train_nd.py --nprocs 8 --dp 4 --tp 2 --zero 1 --microbatches 2
    python scripts/train_nd.py --nprocs 8 --dp 2 --tp 2 --cp 2
    python scripts/train_nd.py --nprocs 8 --dp 2 --ep 4 --experts 4 --top-k 2
    torchrun --standalone --nproc_per_node=8 scripts/train_nd.py --dp 4 --tp 2 --zero 1

Axes in this version: data parallel (``--dp``, with ``--zero 0|1|2`` from chapter 08's
``gc.ZeroOptimizer``), tensor parallel (``--tp``, chapter 09's ``gc.tensor_parallel_gpt``, no
sequence parallelism), context parallel (``--cp``, chapter 11's ``gc.ring_attention`` with the
zig-zag layout: each cp rank holds two chunks of every sequence), expert parallel (``--ep`` with
``--experts E --top-k k``: every feed-forward is a ``gc.MoE`` whose experts ``gc.expert_parallel``
spreads over the ep group), pipeline parallel (``--pp``, chapter 07's ``gc.pipeline_step`` with 1F1B,
combined with any of the other axes — a tp × pp stage is chapter 10's ``gc.PipelineStage3D``; stages
cut by ``gc.stage_layers``), micro-batches (pipeline chunks, or gradient
accumulation without pp) and ``--recompute none|selective|full`` (selective: each attention core
checkpointed; full: each block). ``--zero 3`` is
chapter 08's ``gc.FullyShardedModule`` over dp·cp, one unit per block (with dp, cp, micro-batches and
recomputation).

Mesh order (Megatron-LM's): tp innermost (neighbouring ranks), then cp, ep, dp, pp. cp and ep ranks
are data-parallel ranks for the dense parameters — their gradients are summed over dp·cp·ep; an
expert's over dp·cp (the ranks holding a copy of it); both divided by dp·cp·ep, the number of
pieces the global batch was cut into; with ``--zero 1|2`` the dense states are sharded over dp·cp·ep
and each expert's over dp·cp. Not yet: ZeRO-3 with tp, pp or ep, ZeRO-2 with
``--pp`` (its backward frees each gradient before the stages sum the tied embedding's) and
``--experts`` with ``--tp`` (the flags exist and say so).
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


#: ``--optimizer``: AdamW keeps 8 bytes of fp32 state per parameter; SGD (no momentum) none, and its
#: update is proportional to the gradient — a wrongly scaled gradient shows in the next loss, which
#: Adam's ``m / √v`` hides.
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


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
    p.add_argument("--experts", type=int, default=1, help="experts per MoE feed-forward (1: a dense MLP)")
    p.add_argument("--top-k", type=int, default=1, help="experts per token")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="each expert takes at most this × its mean share of token copies (default: no limit)")
    p.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up)")
    p.add_argument("--optimizer", default="adamw", choices=tuple(OPTIMIZERS),
                   help="adamw (what the planner's optimizer bytes assume) or plain sgd")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--nprocs", type=int, default=0, help="start the ranks with gc.launch instead of torchrun")
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    world = a.dp * a.tp * a.pp * a.cp * a.ep
    unsupported = [what for what, bad in (
        ("--zero 3 with --tp/--pp/--ep", a.zero == 3 and a.tp * a.pp * a.ep > 1),
        ("--experts with --tp", a.experts > 1 and a.tp > 1),
        # ZeRO-2 reduce-scatters (and frees) each gradient in the backward, before the first and last
        # stages can sum the tied embedding's two gradients
        ("--zero 2 with --pp", a.zero == 2 and a.pp > 1)) if bad]
    if unsupported:
        p.error(f"{', '.join(unsupported)}: not supported by this version of train_nd.py "
                "(supported: dp, zero 0-2 (3 with dp and cp only, 2 without pp), tp, cp, ep, pp with any of them, "
                "micro-batches, "
                "recompute none|selective|full)")
    if a.ep > 1 and a.experts % a.ep:
        p.error(f"--ep {a.ep} must divide --experts {a.experts}")
    if a.capacity_factor is not None and not a.capacity_factor > 0:
        p.error(f"--capacity-factor must be > 0, got {a.capacity_factor}")
    if not 1 <= a.top_k <= a.experts:
        p.error(f"--top-k {a.top_k} must be between 1 and --experts {a.experts}")
    if a.seq % (2 * a.cp):
        p.error(f"--seq {a.seq} must divide by 2·cp = {2 * a.cp} (the zig-zag layout cuts 2·cp chunks)")
    if a.pp > a.layers:
        p.error(f"--pp {a.pp} is more stages than --layers {a.layers}")
    if a.global_batch % (a.dp * a.ep * a.microbatches):
        p.error(f"--global-batch {a.global_batch} must divide by dp × ep × microbatches = "
                f"{a.dp * a.ep * a.microbatches}")
    if a.nprocs and a.nprocs != world:
        p.error(f"--nprocs {a.nprocs} but dp·tp·pp·cp·ep = {world}")
    return a


class Optimizers:
    """Several optimizers stepped as one (ZeRO over the dense parameters and over the experts, each
    sharded over the ranks that hold a copy of them)."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]

    @property
    def state(self):
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    def step(self):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


class AllReduceOptimizer:
    """Plain data parallelism (ZeRO-0): sum each parameter set's gradients over its group, divide by
    ``replicas`` (the pieces the global batch was cut into), then step.

    ``buckets``: ``[(params, group), …]`` — dense parameters over dp·cp·ep, experts over dp·cp."""

    def __init__(self, buckets, optim, replicas):
        self.buckets = [(list(params), group) for params, group in buckets if list(params)]
        self.optim, self.replicas = optim, replicas
        self.param_groups = optim.param_groups

    def step(self):
        for params, group in self.buckets:
            flat = torch.cat([p.grad.flatten() for p in params]).contiguous()
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            flat /= self.replicas
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.optim.step()

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad(set_to_none=set_to_none)


MESH = ("tp", "cp", "ep", "dp", "pp")    # innermost first


def make_optimizer(a, model, data_group, expert_group):
    """The optimizer of ``model``'s parameters, with the gradient reduction of the data-parallel ranks:
    dense parameters over ``data_group`` (dp·cp·ep), experts over ``expert_group`` (dp·cp); both
    averaged over the dp·cp·ep pieces of the global batch (ZeRO-1/2 shards each set over its group)."""
    replicas = a.dp * a.cp * a.ep
    experts = {id(p) for m in model.modules() if isinstance(m, gc.ExpertParallelMoE) for p in m.experts.parameters()}
    dense = [p for p in model.parameters() if id(p) not in experts]
    expert = [p for p in model.parameters() if id(p) in experts]
    make = OPTIMIZERS[a.optimizer]
    if a.zero and replicas > 1 and expert:
        # experts: summed over the dp·cp ranks holding a copy, but the batch was cut into dp·cp·ep
        # pieces — ZeroOptimizer averages over its group, so each expert gradient first gets 1/ep
        for p in expert:
            p.register_hook(lambda g: g / a.ep)
        return Optimizers(gc.ZeroOptimizer(dense, make, stage=a.zero, group=data_group, lr=a.lr),
                          gc.ZeroOptimizer(expert, make, stage=a.zero, group=expert_group, lr=a.lr))
    if a.zero and replicas > 1:
        return gc.ZeroOptimizer(list(model.parameters()), make, stage=a.zero, group=data_group, lr=a.lr)
    if replicas > 1:
        return AllReduceOptimizer([(dense, data_group), (expert, expert_group)], make(model.parameters(), lr=a.lr),
                                  replicas)
    return make(model.parameters(), lr=a.lr)


def coordinates(rank, a):
    """``{"tp": …, "cp": …, "ep": …, "dp": …, "pp": …}`` of ``rank`` in the mesh (tp innermost)."""
    out = {}
    for axis in MESH:
        out[axis], rank = rank % getattr(a, axis), rank // getattr(a, axis)
    return out


def mesh_group(rank, world_size, a, varying):
    """The group of the ranks that differ from ``rank`` only along the axes ``varying``.

    Every rank creates every such group, in the same order (``dist.new_group`` is collective)."""
    buckets = {}
    for r in range(world_size):
        c = coordinates(r, a)
        buckets.setdefault(tuple(c[x] for x in MESH if x not in varying), []).append(r)
    mine = None
    for key in sorted(buckets):
        group = dist.new_group(buckets[key])
        if rank in buckets[key]:
            mine = group
    return mine


def mesh_groups(rank, world_size, a):
    """This rank's groups: ``tp``, ``cp``, ``ep``, ``data`` (dp·cp·ep: the ranks holding a copy of the
    dense parameters) and ``expert`` (dp·cp: the ranks holding a copy of my experts) — inside one
    pipeline stage. Every rank creates every group, in the same order."""
    return {name: mesh_group(rank, world_size, a, axes) for name, axes in (
        ("tp", ("tp",)), ("cp", ("cp",)), ("ep", ("ep",)), ("data", ("cp", "ep", "dp")), ("expert", ("cp", "dp")))}


def split_model(a, groups, at):
    """The whole ``gc.TinyGPT`` (seed 0), split: experts over ep, layers over tp, sequences over cp."""
    model = build_model(a)
    if a.ep > 1:
        for block in model.blocks:
            block.mlp.moe = gc.expert_parallel(block.mlp.moe, groups["ep"])
    if a.tp > 1:
        model = gc.tensor_parallel_gpt(model, groups["tp"])
    if a.cp > 1:
        context_parallel(model, groups["cp"], at["cp"], a.cp, a.seq)
    return model


class MoEFeedForward(torch.nn.Module):
    """A block's feed-forward as a mixture of experts: ``(B, T, C)`` → tokens ``(B·T, C)`` → MoE → back."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return self.moe(x.reshape(-1, x.shape[-1])).view_as(x)


class ZigzagPositions(torch.nn.Module):
    """The position embedding of a cp rank: local position ``i`` is global position ``positions[i]``."""

    def __init__(self, embedding, positions):
        super().__init__()
        self.embedding = embedding
        self.register_buffer("positions", positions, persistent=False)

    @property
    def weight(self):
        return self.embedding.weight

    def forward(self, ids):
        return self.embedding(self.positions[ids])


def sdpa_core(q, k, v):
    """The attention core of ``gc.TinyGPT``: causal fused SDPA over ``(B, H, T, D)``."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_forward(attn, core):
    """``attn``'s forward (TinyGPT's or its tensor-parallel heads) with ``core(q, k, v)`` as its core."""
    tp_group = getattr(attn, "group", None) if isinstance(attn, gc.TensorParallelAttention) else None

    def forward(x):                                                     # (B, T, C)
        B, T, _ = x.shape
        if tp_group is not None:
            x = gc.copy_to_tensor_parallel(x, tp_group)
        q, k, v = (torch.nn.functional.linear(x, lin.weight, lin.bias).view(B, T, -1, attn.head_dim).transpose(1, 2)
                   for lin in (attn.q, attn.k, attn.v))                 # (B, H, T, D)
        return attn.proj(core(q, k, v).transpose(1, 2).reshape(B, T, -1))
    return forward


def set_attention_cores(model, make_core):
    """Give every attention of ``model`` the core ``make_core(its current core)``."""
    for attn in model.modules():
        if isinstance(attn, (gc.CausalSelfAttention, gc.TensorParallelAttention)):
            attn.core = make_core(getattr(attn, "core", sdpa_core))
            attn.forward = attention_forward(attn, attn.core)


def recompute_attention_cores(model):
    """Selective recomputation (Korthikanti et al. 2022): only the attention core runs again in the
    backward. With a fused kernel there is no score matrix to drop; the core keeps q, k, v (its
    checkpointed inputs) and the output (the projection's input) and drops its log-sum-exp."""
    set_attention_cores(model, lambda core: lambda q, k, v: checkpoint(core, q, k, v, use_reentrant=False))


def context_parallel(model, group, rank, size, seq):
    """Make ``model`` (``gc.TinyGPT`` or its tensor-parallel split) run on this cp rank's zig-zag shard
    of every sequence — chunks ``rank`` and ``2N−1−rank`` of ``2N``: positions looked up at their
    global place, attention by ``gc.ring_attention`` over ``group``. The batch is split by the caller
    (``gc.zigzag_split(idx, rank, size, dim=1)``, as Megatron-LM's ``get_batch_on_this_cp_rank``);
    every cp rank holds as many tokens, so the mean of the cp ranks' losses (and gradients) is the
    full sequence's."""
    positions = gc.zigzag_split(torch.arange(seq), rank, size, dim=0)
    model.pos_emb = ZigzagPositions(model.pos_emb, positions)
    set_attention_cores(model, lambda _: lambda q, k, v: gc.ring_attention(q, k, v, group, causal=True,
                                                                         layout="zigzag"))
    return model


def build_model(a):
    """The same ``gc.TinyGPT`` on every rank (seed 0); with ``--experts`` every feed-forward a ``gc.MoE``."""
    torch.manual_seed(0)
    model = gc.TinyGPT(vocab_size=a.vocab, seq_len=a.seq, num_layers=a.layers, hidden=a.hidden, num_heads=a.heads)
    if a.experts > 1:
        for block in model.blocks:
            block.mlp = MoEFeedForward(gc.MoE(a.hidden, 4 * a.hidden, a.experts, top_k=a.top_k,
                                                           capacity_factor=a.capacity_factor))
    return model


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
    if isinstance(model, (gc.TensorParallelGPT, gc.PipelineStage3D)):   # blocks inlined in the forward
        inner = model.run_block
        model.run_block = lambda b, x: checkpoint(inner, b, x, use_reentrant=False)
        return
    for i, block in enumerate(model.blocks):                           # TinyGPT or a Stage: blocks are called
        model.blocks[i] = Checkpointed(block)


class Checkpointed(torch.nn.Module):
    """``block`` under full recomputation. The recomputation calls ``block`` itself, so hooks on it
    run again — ZeRO-3 gathers the block's parameters a second time, as FSDP does with activation
    checkpointing (its unit is ``blocks.i.block``)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


class Stage(torch.nn.Module):
    """Pipeline stage ``s`` of a TinyGPT: (embedding) + its blocks (+ final norm and tied head — a copy
    of the embedding on the last stage, as Megatron-LM keeps one; the worker sums the two copies' gradients)."""

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
    """pp (outermost) × dp × ep × cp × tp (innermost): 1F1B over ``a.microbatches``, gradients reduced
    over the stage's data-parallel ranks after the step. With tp, the stage is chapter 10's
    ``gc.PipelineStage3D`` of the tensor-parallel model (every rank splits the whole model over its tp
    group, then keeps its stage's blocks), and the loss is the vocabulary-parallel cross-entropy; with
    cp, every stage's attention is ring attention over its cp group on the zig-zag shard of each
    sequence; with ep, every stage's feed-forwards are expert-parallel over its ep group."""
    torch.set_num_threads(a.threads)
    at = coordinates(rank, a)
    pp_rank, tp_rank = at["pp"], at["tp"]
    per = world_size // a.pp                                            # ranks per stage
    inner = rank % per                                                  # my place inside the stage
    groups = mesh_groups(rank, world_size, a)                           # within this stage
    tp_group, data_group, expert_group = groups["tp"], groups["data"], groups["expert"]
    emb_groups = [dist.new_group([i, (a.pp - 1) * per + i]) for i in range(per)]   # first + last stage: tied copies
    model = split_model(a, groups, at)
    if a.tp > 1:
        counts = gc.stage_layers(a.layers, a.pp)
        blocks = list(range(sum(counts[:pp_rank]), sum(counts[:pp_rank + 1])))
        stage = gc.PipelineStage3D(model, blocks, first=pp_rank == 0, last=pp_rank == a.pp - 1)
    else:
        stage = Stage(model, pp_rank, a.pp)
    if a.recompute == "full":
        checkpoint_blocks(stage)
    elif a.recompute == "selective":
        recompute_attention_cores(stage)
    params = list(stage.parameters())
    opt = make_optimizer(a, stage, data_group, expert_group)
    comm = gc.PipelineComm(ranks=[p * per + inner for p in range(a.pp)])
    schedule = gc.make_schedule("1f1b", a.pp, a.microbatches)
    local = a.global_batch // (a.dp * a.ep)
    g = torch.Generator().manual_seed(1000 + at["dp"] * a.ep + at["ep"])  # the batches worker() draws
    batches = [torch.randint(0, a.vocab, (local, a.seq), generator=g) for _ in range(2)]
    if a.cp > 1:                                                        # this cp rank's two chunks
        batches = [gc.zigzag_split(b, at["cp"], a.cp, dim=1) for b in batches]
    shape = (a.seq // a.cp, a.hidden)
    ends = pp_rank in (0, a.pp - 1)
    tied = (stage.tok_emb.weight if pp_rank == 0 or a.tp > 1 else stage.head) if ends else None

    def loss_fn(logits, t):
        if a.tp > 1:                                                    # this rank's V/tp logits
            return gc.vocab_parallel_cross_entropy(logits, t, tp_group)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten())

    times, losses, peak = [], [], 0
    for step in range(a.steps + 1):
        x = batches[step % 2]
        dist.barrier()
        start = time.perf_counter()
        out = gc.pipeline_step(stage, schedule, comm, batch_size=local, in_shape=shape, out_shape=shape,
                               inputs=x if comm.is_first else None, targets=x if comm.is_last else None,
                               loss_fn=loss_fn, check_neighbours=step == 0, measure_activations=step == 0)
        if tied is not None:                            # lookup (first stage) + head (last stage) gradients
            dist.all_reduce(tied.grad, group=emb_groups[inner])
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
        total = torch.tensor([out["loss"] / (a.dp * a.cp * a.ep) if comm.is_last and tp_rank == 0 else 0.0])
        dist.all_reduce(total)                                          # the global batch's mean loss
        losses.append(total.item())
    comm.wait()
    return {"rank": rank, "dp": a.dp, "tp": a.tp, "pp": a.pp, "cp": a.cp, "ep": a.ep, "stage": pp_rank,
            "zero": a.zero, "microbatches": a.microbatches, "recompute": a.recompute, "params": param_bytes,
            "grads": grads, "optimizer": optimizer_bytes, "activations": peak, "step_time": statistics.median(times),
            "losses": losses}


def worker(rank, world_size, a):
    if a.pp > 1:
        return pipeline_worker(rank, world_size, a)
    torch.set_num_threads(a.threads)
    at = coordinates(rank, a)
    groups = mesh_groups(rank, world_size, a)
    data_group, expert_group = groups["data"], groups["expert"]
    replicas = a.dp * a.cp * a.ep                                         # pieces of the global batch
    model = split_model(a, groups, at)
    if a.recompute == "full":
        checkpoint_blocks(model)
    elif a.recompute == "selective":
        recompute_attention_cores(model)
    loss_of = model.loss
    if a.zero == 3 and replicas > 1:
        # ZeRO-3, wrapped as FSDP is: one unit per block and a root unit for the rest (the embeddings,
        # kept gathered through the forward for the tied head, and the final norm) — 3 collectives
        # per unit and micro-batch; one unit per layer made 56 per step and ran 28-33% slower
        model = gc.FullyShardedModule(model, group=data_group, units=["", *(
            f"blocks.{i}.block" if isinstance(b, Checkpointed) else f"blocks.{i}" for i, b in enumerate(model.blocks))])

        def loss_of(idx, targets):        # TinyGPT.loss, called through the sharded wrapper
            return torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
        opt = OPTIMIZERS[a.optimizer](model.parameters(), lr=a.lr)
    else:
        opt = make_optimizer(a, model, data_group, expert_group)
    data_rank = at["dp"] * a.ep + at["ep"]                                # tp and cp ranks share their batch
    micro = a.global_batch // (a.dp * a.ep) // a.microbatches
    g = torch.Generator().manual_seed(1000 + data_rank)
    batches = [torch.randint(0, a.vocab, (a.microbatches, micro, a.seq), generator=g) for _ in range(2)]
    if a.cp > 1:                                                          # this cp rank's two chunks
        batches = [gc.zigzag_split(b, at["cp"], a.cp, dim=2) for b in batches]

    wrapped = LossOf(model, loss_of)
    wrapped.targets = batches[0][0]
    memory = gc.measure_step_memory(wrapped, opt, batches[0][0], batches[0][0], loss_fn=lambda out, target: out)

    times, losses = [], []
    for step in range(a.steps + 1):
        x = batches[step % 2]
        dist.barrier()
        start = time.perf_counter()
        total = 0.0
        for m in range(a.microbatches):
            loss = loss_of(x[m], x[m]) / a.microbatches
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=False)
        t = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)                          # a step ends when the slowest rank ends
        if step:
            times.append(t.item())
        total = torch.tensor([total])
        dist.all_reduce(total, group=data_group)                          # the global batch's mean loss
        losses.append(total.item() / replicas)
    return {"rank": rank, "dp": a.dp, "tp": a.tp, "pp": a.pp, "cp": a.cp, "ep": a.ep, "zero": a.zero,
            "microbatches": a.microbatches, "recompute": a.recompute, "experts": a.experts, "top_k": a.top_k,
            "capacity_factor": a.capacity_factor,
            "params": memory.parameters, "grads": memory.gradients, "optimizer": memory.optimizer_state,
            "activations": memory.activations, "step_time": statistics.median(times), "losses": losses}


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
