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

Exit status: 0 when the target is met, 1 when it is not (everything is printed either way).
"""

import argparse
import sys

import torch

import gpucourse as gc

TARGET = 2.0


def bf16_cpu_flags():
    """The CPU's bf16 instruction sets, from /proc/cpuinfo (Linux; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags]


def report(runs):
    print(gc.format_comparison(*(r.timing for r in runs)))
    width = max(len(r.timing.name) for r in runs)
    for r in runs:
        print(f"  time split, {r.timing.name:<{width}}: {r.split}")
    p = runs[0].split.share("matmul")
    print(f"  fp32 matmul share p = {p:.0%}: even infinitely fast matmuls give at most "
          f"{1 / (1 - p) if p < 1 else float('inf'):.1f}x")
    return gc.speedup(runs[0].timing, runs[1].timing)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="intra-op CPU threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"bf16 instructions: {', '.join(bf16_cpu_flags()) or 'none found'}, {torch.get_num_threads()} thread(s)")

    print("\n== 1) matmul-heavy: MLP 1024 -> 4096 -> 1024, batch 512")
    ratio = report(gc.compare_precisions(lambda: gc.MLP(1024, 4096, 1024), 512, 1024, repeats=10, name="MLP"))

    print("\n== 2) element-wise-bound: ElementwiseNet(width=32, depth=4, ops=2), batch 32768")
    eratio = report(gc.compare_precisions(lambda: gc.ElementwiseNet(32, 4, 2), 32768, 32, repeats=10,
                                          name="ElementwiseNet"))
    print(f"  -> {eratio:.2f}x: its time is in element-wise ops, which bf16 does not make "
          "faster on a CPU (they are limited by memory traffic), and autocast adds casts.")

    if torch.cuda.is_available():
        dtypes = (None, torch.float16) + ((torch.bfloat16,) if torch.cuda.is_bf16_supported() else ())
        print(f"\n== CUDA ({torch.cuda.get_device_name()}): MLP 1024 -> 4096 -> 1024, batch 512")
        report(gc.compare_precisions(lambda: gc.MLP(1024, 4096, 1024), 512, 1024, device="cuda",
                                     dtypes=dtypes, repeats=30, name="MLP"))

    met = ratio >= TARGET
    print(f"\nMLP training step, bf16 autocast vs fp32 on CPU: {ratio:.2f}x (target >= {TARGET:.0f}x): "
          f"{'MET' if met else 'NOT MET'}")
    if not met and not bf16_cpu_flags():
        print("  (no bf16 instructions found on this CPU; the target assumes AMX or AVX-512-bf16)")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
