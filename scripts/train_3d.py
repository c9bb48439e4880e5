"""3-D parallelism on one laptop: TinyGPT with data × tensor × pipeline parallelism (chapter 10's capstone).

The ranks form a mesh ``init_device_mesh(device, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))``:
tp varies fastest (tensor-parallel peers are consecutive ranks: one node), pp slowest (pipeline
neighbours are ``dp × tp`` ranks apart: the only traffic that should cross nodes). Each rank runs one
pipeline stage (chapter 07) of a TinyGPT split over its tp group (chapter 09), with a ZeRO-1
optimizer over its dp group (chapter 08) — ``gc.train_3d`` is the per-rank code.

    # 8 local processes, a 2 x 2 x 2 mesh, checked against the one-process run over 20 steps
    python scripts/train_3d.py --nprocs 8 --pp 2 --dp 2 --tp 2 --compare
    # the same under torchrun
    torchrun --standalone --nproc_per_node=8 scripts/train_3d.py --pp 2 --dp 2 --tp 2 --compare
    # 2 nodes x 8 GPUs (run on each node with its --node_rank): tp=4 inside a node, pp=2 across nodes
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 \\
        scripts/train_3d.py --pp 2 --dp 2 --tp 4 --heads 4 --batch-size 32

Rank 0 prints the loss of every step and one final line::

    final loss L | mesh (pp, dp, tp) = (P, D, T) | fp32 or bf16 | S ms/step [| vs one process: ...]

``--precision auto`` (the default) uses bf16 autocast where the CPU multiplies bf16 in hardware
(``gc.has_bf16_units()``; elsewhere bf16 is emulated and much slower) or on CUDA, fp32 otherwise.
``--compare`` also trains the same model on the same data in one process and exits with status 1
if a step's loss differs by more than the tolerance (1e-4 in fp32, 2e-2 in bf16). ``--json PATH``
writes every rank's measurements (losses, memory, bytes per axis, step times, pipeline events).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

try:
    import gpucourse as gc
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import gpucourse as gc

TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=2, help="data-parallel size (pipelines side by side)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (ranks per layer)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--nprocs", type=int, default=None,
                   help="without torchrun: start this many local processes (= dp * tp * pp, the default)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="the global batch (a multiple of --dp)")
    p.add_argument("--chunks", type=int, default=2, help="micro-batches per pipeline and step")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2, help="TinyGPT blocks (>= --pp)")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=2, help="attention heads (>= --tp)")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    p.add_argument("--compare", action="store_true", help="check the losses against one process")
    p.add_argument("--json", default=None, help="write the measurements of every rank here")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    args = p.parse_args(argv)
    for name in ("dp", "tp", "pp", "steps", "batch_size", "chunks", "layers", "hidden", "heads", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def model_config(args) -> dict:
    vocab = gc.TinyText(20_000, args.seed).vocab_size
    return dict(vocab_size=vocab, seq_len=args.seq_len, num_layers=args.layers, hidden=args.hidden,
                num_heads=args.heads)


def use_bf16(precision: str, device: str) -> bool:
    if precision == "auto":
        return device.startswith("cuda") or gc.has_bf16_units()
    return precision == "bf16"


def train_kwargs(args, bf16: bool) -> dict:
    return dict(config=model_config(args), dp=args.dp, tp=args.tp, pp=args.pp, steps=args.steps,
                batch_size=args.batch_size, chunks=args.chunks, lr=args.lr, seed=args.seed, bf16=bf16,
                schedule=args.schedule)


def report(results: list[dict], args, bf16: bool, *, printed_steps: bool) -> int:
    """Rank 0's output: per-step losses (unless printed live), the final line, the JSON file."""
    first = results[0]
    if not printed_steps:
        for step, (loss, t) in enumerate(zip(first["losses"], first["step_times"])):
            print(f"step {step:3d}  loss {loss:.4f}  ({t * 1e3:.0f} ms)")
    precision = "bf16" if bf16 else "fp32"
    line = (f"final loss {first['losses'][-1]:.4f} | mesh (pp, dp, tp) = ({args.pp}, {args.dp}, {args.tp}) | "
            f"{precision} | {first['step_time'] * 1e3:.0f} ms/step")
    status, reference = 0, None
    if args.compare:
        torch.set_num_threads(1)
        cfg = train_kwargs(args, bf16)
        reference = gc.train_reference_3d(cfg["config"], steps=args.steps, batch_size=args.batch_size,
                                          lr=args.lr, seed=args.seed, bf16=bf16)
        worst = max(abs(a - b) for a, b in zip(first["losses"], reference["losses"]))
        ok = worst <= TOLERANCE[precision]
        status = 0 if ok else 1
        line += (f" | vs one process: max |Δloss| {worst:.1e} {'<=' if ok else '>'} {TOLERANCE[precision]:g} "
                 f"{'match' if ok else 'MISMATCH'}")
    if args.json:
        ranks = [{**{k: v for k, v in r.items() if k != "events"},
                  "events": [[e.stage, e.kind, e.microbatch, e.start, e.end] for e in r["events"]]}
                 for r in results]
        with open(args.json, "w") as f:
            json.dump({"mesh": {"pp": args.pp, "dp": args.dp, "tp": args.tp}, "precision": precision,
                       "tolerance": TOLERANCE[precision], "config": model_config(args),
                       "batch_size": args.batch_size, "chunks": args.chunks, "ranks": ranks,
                       "reference": reference}, f)
    print(line, flush=True)
    return status


def main(argv=None) -> int:
    args = parse_args(argv)
    world = args.dp * args.tp * args.pp
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:          # under torchrun
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world_size != world:
            raise SystemExit(f"torchrun started {world_size} processes, but --pp x --dp x --tp = {world}")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        # one GPU per process on this machine, else gloo on the CPU (gc.default_backend says why)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        on_gpu = gc.default_backend(local_world, say=rank == 0) == "nccl"
        device = f"cuda:{local_rank}" if on_gpu else "cpu"
        if on_gpu:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if on_gpu else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
        bf16 = use_bf16(args.precision, device)
        mine = gc.train_3d(rank, world_size, **train_kwargs(args, bf16), device=device, verbose=True)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine)
        status = report(gathered, args, bf16, printed_steps=True) if rank == 0 else 0
        dist.destroy_process_group()
        return status
    nprocs = world if args.nprocs is None else args.nprocs
    if nprocs != world:
        raise SystemExit(f"--nprocs {nprocs} must equal --pp x --dp x --tp = {world}")
    bf16 = use_bf16(args.precision, "cpu")
    results = gc.run_3d(**train_kwargs(args, bf16), timeout=args.timeout)
    return report(results, args, bf16, printed_steps=False)


if __name__ == "__main__":
    sys.exit(main())
