"""Mixed precision speed: a training step in fp32 vs bf16 autocast, and a model where it does not help.

1) matmul-heavy: MLP 1024 -> 4096 -> 1024 (ReLU), batch 512, SGD step — almost all of its time is
   in matrix products, which bf16 autocast runs on the CPU's bf16 units (AMX / AVX-512-bf16);
2) element-wise-bound: gc.ElementwiseNet(width=32, depth=4, ops=2), batch 32768 — most of its time
   is in activations and adds, which autocast does not speed up, plus the casts autocast adds.

For each, the fp32 step's share of time in matmuls (gc.op_time_shares) gives the Amdahl bound
that explains the ratio. On a CUDA machine the MLP is also timed on the GPU (fp16 + loss scaler,
bf16) — those ratios are printed for information, the target is the CPU one.

    python benchmarks/mixed_precision.py             # target: MLP bf16 >= 2x fp32 on 1 CPU thread
    python benchmarks/mixed_precision.py --threads 2
"""

import argparse

import torch

import gpucourse as gc

TARGET = 2.0


def compare(name, make_model, batch, in_features, out_features, device="cpu", dtypes=(torch.bfloat16,),
            repeats=10):
    """Time one training step per dtype on identical fresh models; return (baseline, timings, op shares)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, in_features, generator=g).to(device)
    y = torch.randn(batch, out_features, generator=g).to(device)
    timings, shares = [], []
    for dtype in (None, *dtypes):
        torch.manual_seed(0)
        model = make_model().to(device)
        scaler = gc.LossScaler() if dtype is torch.float16 else None
        step = gc.training_step(model, x, y, dtype=dtype, scaler=scaler)
        label = f"{name} {'fp32' if dtype is None else str(dtype).replace('torch.', '')} ({device})"
        timings.append(gc.measure(step, repeats=repeats, warmup=2, name=label))
        shares.append((label, gc.op_time_shares(step)))
    return timings[0], timings[1:], shares


def report(baseline, others, shares):
    print(gc.format_comparison(baseline, *others))
    width = max(len(label) for label, _ in shares)
    for label, times in shares:
        print(f"  time split, {label:<{width}}: {times}")
    p = shares[0][1].share("matmul")
    print(f"  fp32 matmul share p = {p:.0%}: even infinitely fast matmuls give at most "
          f"{1 / (1 - p) if p < 1 else float('inf'):.1f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="intra-op CPU threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} thread(s)")

    print("\n== 1) matmul-heavy: MLP 1024 -> 4096 -> 1024, batch 512")
    base, (bf16,), shares = compare("MLP", lambda: gc.MLP(1024, 4096, 1024), 512, 1024, 1024)
    report(base, [bf16], shares)
    ratio = gc.speedup(base, bf16)

    print("\n== 2) element-wise-bound: ElementwiseNet(width=32, depth=4, ops=2), batch 32768")
    ebase, (ebf16,), eshares = compare("ElementwiseNet", lambda: gc.ElementwiseNet(32, 4, 2), 32768, 32, 32)
    report(ebase, [ebf16], eshares)
    print(f"  -> {gc.speedup(ebase, ebf16):.2f}x: its time is in element-wise ops, which bf16 does not make "
          "faster on a CPU (they are limited by memory traffic), and autocast adds casts.")

    if torch.cuda.is_available():
        dtypes = (torch.float16, torch.bfloat16) if torch.cuda.is_bf16_supported() else (torch.float16,)
        print(f"\n== CUDA ({torch.cuda.get_device_name()}): MLP 1024 -> 4096 -> 1024, batch 512")
        cbase, cothers, cshares = compare("MLP", lambda: gc.MLP(1024, 4096, 1024), 512, 1024, 1024,
                                          device="cuda", dtypes=dtypes, repeats=30)
        report(cbase, cothers, cshares)

    met = ratio >= TARGET
    print(f"\nMLP training step, bf16 autocast vs fp32 on CPU: {ratio:.2f}x (target >= {TARGET:.0f}x): "
          f"{'MET' if met else 'NOT MET'}")
    if not met and torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"):
        print("  (this CPU has no fast bf16 instructions; the target assumes AMX or AVX-512-bf16)")


if __name__ == "__main__":
    main()
