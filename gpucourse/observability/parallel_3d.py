"""3-D parallelism: TinyGPT trained with data × tensor × pipeline parallelism at once — the capstone.

``world = pp × dp × tp`` processes on a mesh ``init_device_mesh(…, (pp, dp, tp), ("pp", "dp", "tp"))``;
the **last** dim varies fastest, so rank ``= (pp_rank · dp + dp_rank) · tp + tp_rank``::

    tp  innermost  consecutive ranks — one node: 4 all-reduces of (B, T, C) per block, fw + bw
    dp  middle     the same stage of the other pipelines: one reduce-scatter + all-gather per step
    pp  outermost  ranks dp·tp apart — across nodes: only the activations at the stage boundary

Every rank

1) builds the **same** ``TinyGPT`` (same seed) and splits it over its tp group with
   ``gc.tensor_parallel_gpt`` (chapter 09). Splitting checks that the ranks agree with a
   collective over *all* ranks, so every rank splits the *whole* model, in the same order — then
   keeps only its pipeline stage's pieces (:class:`PipelineStage3D`);
2) runs its stage in the pipeline of its (dp, tp) coordinates with ``gc.pipeline_step``
   (chapter 07: micro-batches, 1F1B). Inside the stage the tp group talks (f/g, vocabulary-parallel
   loss); between stages, send/recv;
3) sums the gradient of the **tied** embedding over the first and last stage (the first uses it
   as the lookup table, the last as the head: Megatron's "embedding group");
4) steps a ZeRO-1 optimizer (``gc.ZeroOptimizer``, chapter 08) over its dp group: reduce-scatter
   the gradients (averaging the dp shards of the batch), AdamW on 1/dp of the stage, all-gather.

Losses, parameters after each step and hence the loss curve equal the one-process run's
(:func:`train_reference_3d`) up to rounding. ``bf16`` runs each stage's forward under
``torch.autocast("cpu", torch.bfloat16)`` (chapter 06; fast only where the CPU has bf16 units).
The measurements — memory per rank, bytes per axis, step time — are :mod:`.parallel_3d_runs`.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..data import TinyGPT, TinyText
from ..pipeline import PipelineComm, make_schedule, pipeline_step
from ..runtime import check_choice, check_int, check_positive
from ..sharding import ZeroOptimizer
from ..tensor_parallel import (
    TensorParallelGPT,
    comm_meter,
    copy_to_tensor_parallel,
    tensor_parallel_gpt,
    vocab_parallel_cross_entropy,
)

__all__ = ["MESH_DIMS", "PipelineStage3D", "train_3d", "check_3d_args"]

#: the mesh's dimension names, outermost first (tp varies fastest: tp peers are neighbours)
MESH_DIMS = ("pp", "dp", "tp")


class PipelineStage3D(nn.Module):
    """One pipeline stage of a tensor-parallel TinyGPT: its blocks, plus the embedding (first stage)
    and the final LayerNorm and tied head (last stage).

    Args:
        tp_model: the whole model split over this rank's tp group (``gc.tensor_parallel_gpt``).
        blocks: the indices of this stage's transformer blocks.
        first, last: is this the first / the last stage (one stage: both).
        bf16: run the forward under ``torch.autocast(<its device>, torch.bfloat16)``.

    ``forward``: first stage ``(B, T)`` token ids, otherwise ``(B, T, C)`` activations →
    ``(B, T, C)`` fp32 activations, or on the last stage this rank's logits ``(B, T, V_tp)``.

    Example::

        >>> _ = torch.manual_seed(0)
        >>> model = TinyGPT(vocab_size=20, seq_len=8, num_layers=2, hidden=16, num_heads=2)
        >>> tp_model = tensor_parallel_gpt(model)                  # one process: tp = 1
        >>> first = PipelineStage3D(tp_model, [0], first=True, last=False)
        >>> last = PipelineStage3D(tp_model, [1], first=False, last=True)
        >>> idx = torch.randint(0, 20, (3, 8))
        >>> torch.allclose(last(first(idx)), model(idx), atol=1e-6)
        True

    .. warning::
        The first and the last stage each hold a copy of the token embedding (tied to the head):
        their gradients must be summed over the two stages before every step, or the copies drift
        apart and the model is no longer the one-process model.
    """

    def __init__(self, tp_model: nn.Module, blocks, *, first: bool, last: bool, bf16: bool = False):
        super().__init__()
        self.first, self.last, self.bf16, self.group = first, last, bf16, tp_model.group
        self.tok_emb = tp_model.tok_emb if first or last else None     # lookup and/or tied head
        self.pos_emb = tp_model.pos_emb if first else None
        self.blocks = nn.ModuleList(tp_model.blocks[i] for i in blocks)
        self.ln_f = tp_model.ln_f if last else None

    run_block = staticmethod(TensorParallelGPT.run_block)                # one block; wrap it to checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            if self.first:                                               # (B, T) -> (B, T, C)
                x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
            for b in self.blocks:                                        # tp group: f/g inside
                x = self.run_block(b, x)
            if self.last:                                                # (B, T, V_tp), tied head
                x = copy_to_tensor_parallel(self.ln_f(x), self.group, label="head")
                return F.linear(x, self.tok_emb.weight).float()         # the loss in fp32
        return x.float()                                                 # fp32 on the wire


class _CountingComm(PipelineComm):
    """The pipeline's send/recv, counting the bytes this stage sends (activations and gradients)."""

    sent = messages = 0

    def send_forward(self, activation, microbatch):
        self.sent, self.messages = self.sent + activation.numel() * activation.element_size(), self.messages + 1
        super().send_forward(activation, microbatch)

    def send_backward(self, grad, microbatch):
        self.sent, self.messages = self.sent + grad.numel() * grad.element_size(), self.messages + 1
        super().send_backward(grad, microbatch)


def train_3d(rank: int, world_size: int, config: dict, *, dp: int, tp: int, pp: int, steps: int = 20,
             batch_size: int = 8, chunks: int = 2, lr: float = 3e-3, seed: int = 0, bf16: bool = False,
             schedule: str = "1f1b", text_chars: int = 20_000, device: str = "cpu",
             verbose: bool = False) -> dict:
    """The per-rank function of a 3-D run (``gc.launch`` or torchrun); see the module doc.

    Args:
        rank, world_size: this process; ``world_size = pp × dp × tp``.
        config: ``TinyGPT(**config)``: ``num_layers >= pp``, ``num_heads >= tp``.
        dp, tp, pp: the mesh's sizes.
        steps, batch_size, lr, seed, text_chars: as in ``gc.train_tinygpt`` (AdamW on ``TinyText``);
            ``batch_size`` is the global batch, a multiple of ``dp``.
        chunks: micro-batches per pipeline per step (``<= batch_size / dp``).
        bf16: bf16 autocast in every stage's forward.
        schedule: ``"1f1b"`` or ``"gpipe"``.
        device: ``"cpu"`` (gloo), or this rank's ``"cuda:<local rank>"`` under torchrun with NCCL.
        verbose: rank 0 prints the loss of every step as it goes.

    Returns:
        ``coords`` (``{"pp", "dp", "tp"}``), ``losses`` (the global batch's loss per step, on every
        rank), ``step_times`` (seconds), ``memory`` (bytes of ``params``, ``grads``, ``optimizer``
        state and peak saved ``activations`` on this rank), ``bytes`` (sent per step by this rank,
        per axis: ``tp`` collectives, ``pp`` send/recv, ``embedding`` (tied copy, all-reduced over
        the first and last stage), ``dp`` reduce-scatter + all-gather payload), ``messages`` (how
        many collectives or sends per step, per axis), ``events`` (the
        last step's pipeline :class:`~gpucourse.TimelineEvent` s).

    Example::

        >>> import functools, gpucourse as gc
        >>> cfg = dict(vocab_size=27, seq_len=4, num_layers=2, hidden=8, num_heads=2)
        >>> run = functools.partial(train_3d, config=cfg, dp=1, tp=1, pp=2, steps=2, batch_size=2)
        >>> out = gc.launch(run, 2)
        >>> ref = gc.train_reference_3d(cfg, steps=2, batch_size=2)["losses"]
        >>> [round(a - b, 5) for a, b in zip(out[0]["losses"], ref)]
        [0.0, 0.0]

    .. warning::
        Every rank must create the same groups and split the same layers in the same order —
        ``init_device_mesh``, ``new_group`` and the tensor-parallel checks are collectives over
        all ranks. A rank that skips one leaves the others waiting until the timeout.
    """
    from torch.distributed.device_mesh import init_device_mesh

    check_3d_args(config, dp=dp, tp=tp, pp=pp, steps=steps, batch_size=batch_size, chunks=chunks, lr=lr,
                  schedule=schedule, text_chars=text_chars, seed=seed)
    if world_size != pp * dp * tp:
        raise ValueError(f"world_size {world_size} != pp × dp × tp = {pp} × {dp} × {tp}")
    data = TinyText(text_chars, seed)
    torch.set_num_threads(1)
    # -- the mesh: one process group per dim (every rank creates every group) ------------------
    device = torch.device(device)
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)
    p, d, t = (mesh.get_local_rank(name) for name in MESH_DIMS)
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    grid = mesh.mesh                                                    # (pp, dp, tp) global ranks
    pipeline_ranks = grid[:, d, t].tolist()                             # my pipeline, stage order
    emb_group = None                                                    # first + last stage, tied
    for dd in range(dp):
        for tt in range(tp):
            ends = sorted({int(grid[0, dd, tt]), int(grid[-1, dd, tt])})
            group = dist.new_group(ends) if pp > 1 else None
            if (dd, tt) == (d, t):
                emb_group = group
    # -- 1) the same model everywhere, split over the tp group, cut to my stage -----------------
    torch.manual_seed(seed)
    tp_model = tensor_parallel_gpt(TinyGPT(**config), tp_group)
    blocks = torch.tensor_split(torch.arange(config["num_layers"]), pp)[p].tolist()
    stage = PipelineStage3D(tp_model, blocks, first=p == 0, last=p == pp - 1, bf16=bf16).to(device)
    del tp_model
    comm = _CountingComm(pipeline_ranks, device=device)
    sched = make_schedule(schedule, pp, chunks)
    opt = ZeroOptimizer(stage.parameters(), torch.optim.AdamW, stage=1, group=dp_group, lr=lr)
    T, local = config["seq_len"], batch_size // dp
    boundary = (T, config["hidden"])
    loss_fn = lambda logits, target: vocab_parallel_cross_entropy(logits, target, tp_group)
    losses, times, emb_bytes, peak_act, result = [], [], 0, 0, {}
    with comm_meter() as meter:
        for step in range(steps):
            dist.barrier()                                              # time the slowest rank
            start = time.perf_counter()
            x, y = (z.to(device) for z in data.batch(batch_size, T, step))   # the global batch ...
            rows = slice(d * local, (d + 1) * local)                    # ... my pipeline's rows
            opt.zero_grad()
            # 2) forward and backward of my stage, micro-batch by micro-batch (tp talks inside)
            result = pipeline_step(stage, sched, comm, batch_size=local, in_shape=boundary,
                                   out_shape=boundary, inputs=x[rows] if p == 0 else None,
                                   targets=y[rows] if p == pp - 1 else None, loss_fn=loss_fn,
                                   check_neighbours=step == 0, measure_activations=step == 0)
            peak_act = max(peak_act, result["peak_activation_bytes"] or 0)
            # 3) the tied embedding: lookup gradient (first stage) + head gradient (last stage)
            if emb_group is not None and stage.tok_emb is not None:
                dist.all_reduce(stage.tok_emb.weight.grad, group=emb_group)
                emb_bytes += stage.tok_emb.weight.grad.numel() * 4
            # 4) ZeRO-1 over dp: reduce-scatter (average), AdamW on my shard, all-gather
            opt.step()
            # the loss lives on the last stage (each dp rank: its rows' mean): share it with all
            mine = result["loss"] / dp if p == pp - 1 and t == 0 else 0.0
            total = torch.tensor([mine], dtype=torch.float32, device=device)
            dist.all_reduce(total)
            times.append(time.perf_counter() - start)
            losses.append(float(total))
            if verbose and rank == 0:
                print(f"step {step:3d}  loss {losses[-1]:.4f}  ({times[-1] * 1e3:.0f} ms)", flush=True)
    n_params = sum(q.numel() for q in stage.parameters())
    return {
        "coords": {"pp": p, "dp": d, "tp": t}, "losses": losses, "step_times": times,
        "step_time": statistics.median(times),
        "num_params": n_params,
        "memory": {"params": 4 * n_params, "grads": 4 * n_params,
                   "optimizer": sum(v.numel() * v.element_size() for s in opt.state.values()
                                    for v in s.values() if torch.is_tensor(v) and v.dim() > 0),
                   "activations": peak_act},
        "bytes": {"tp": meter.bytes() // steps, "pp": comm.sent // steps, "embedding": emb_bytes // steps,
                  "dp": 2 * opt.flat.numel() * opt.flat.element_size() if dp > 1 else 0},
        "messages": {"tp": meter.count() // steps, "pp": comm.messages // steps,
                     "embedding": int(emb_group is not None and stage.tok_emb is not None), "dp": 2 * (dp > 1)},
        "events": result["events"], "bf16": bf16,
    }


def check_3d_args(config: dict, *, dp: int, tp: int, pp: int, steps: int, batch_size: int, chunks: int,
                  lr: float, schedule: str = "1f1b", text_chars: int = 20_000, seed: int = 0) -> None:
    """Raise ``ValueError``/``TypeError`` for a 3-D run no mesh can run — in the parent, before any process starts.

    Example::

        >>> cfg = dict(vocab_size=27, seq_len=4, num_layers=2, hidden=8, num_heads=2)
        >>> check_3d_args(cfg, dp=2, tp=2, pp=2, steps=1, batch_size=4, chunks=2, lr=1e-3)
        >>> check_3d_args(cfg, dp=2, tp=2, pp=4, steps=1, batch_size=4, chunks=2, lr=1e-3)
        Traceback (most recent call last):
        ...
        ValueError: pp=4 stages need num_layers >= 4 (one block per stage at least), got num_layers=2
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict of TinyGPT arguments, got {type(config).__name__}")
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("steps", steps), ("batch_size", batch_size)):
        check_int(name, value, 1)
    check_int("chunks", chunks, 1, hint=" (micro-batches per pipeline)")
    check_positive("lr", lr)
    check_choice("schedule", schedule, ("1f1b", "gpipe"))
    layers, heads = config.get("num_layers", 2), config.get("num_heads", 4)
    if layers < pp:
        raise ValueError(f"pp={pp} stages need num_layers >= {pp} (one block per stage at least), "
                         f"got num_layers={layers}")
    if heads < tp:
        raise ValueError(f"tp={tp} needs num_heads >= {tp} (whole heads per rank), got num_heads={heads}")
    chars = TinyText(text_chars, seed).vocab_size
    if config.get("vocab_size", 64) < chars:
        raise ValueError(f"config['vocab_size'] = {config.get('vocab_size', 64)} is smaller than the text's "
                         f"{chars} characters (gc.TinyText({text_chars}, {seed}).vocab_size)")
    if batch_size % dp:
        raise ValueError(f"batch_size ({batch_size}) must be a multiple of dp ({dp}): ZeRO averages "
                         "the dp ranks' gradients, which is the global mean only for equal shares")
    if batch_size // dp < chunks:
        raise ValueError(f"each pipeline gets batch_size / dp = {batch_size // dp} rows, fewer than "
                         f"chunks={chunks} micro-batches")
