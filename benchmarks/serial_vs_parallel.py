"""Serial vs parallel on this machine: vectorisation, and threads vs processes at 2 workers.

Every ratio is against a baseline measured in the same run (median of several repeats):

1) SISD vs SIMD — a Python loop vs ``torch.dot`` on the same numbers, and the same torch op with
   its SIMD code paths switched off (``ATEN_CPU_CAPABILITY=default``) vs this CPU's best;
2) MIMD — the same CPU-bound job split over 2 threads or 2 processes vs 1 worker, for pure-Python
   work (holds the GIL) and for torch work (releases it), each with one intra-op thread.

    python benchmarks/serial_vs_parallel.py
    # targets: torch work in 2 threads >= 1.6x; pure-Python work in 2 threads ~ 1x (0.8-1.2x)

Run it on an otherwise idle machine with at least 2 cores.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gpucourse as gc  # noqa: E402

WORKERS = 2
PYTHON_STEPS = 6_000_000        # ~0.25 s of pure-Python work on one core
TORCH_PRODUCTS = 8_000          # ~0.25 s of 128x128 matrix products on one core


def vectorisation() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1 << 16, generator=g), torch.randn(1 << 16, generator=g)
    loop = gc.measure(lambda: gc.dot_loop(a, b), repeats=5, name="Python loop (SISD)")
    vec = gc.measure(lambda: torch.dot(a, b), repeats=50, name="torch.dot (vectorised)")
    print("== 1) dot product of 65,536 float32 numbers")
    print(gc.format_comparison(loop, vec))
    best = gc.cpu_capability()
    base = gc.time_with_cpu_capability("default", op="sum", repeats=200)
    simd = gc.time_with_cpu_capability(best, op="sum", repeats=200)
    print(f"   the same torch sum with SIMD off vs on ({best}):")
    print("   " + gc.format_comparison(base, simd).replace("\n", "\n   "))


def split(total: int) -> list[int]:
    return gc.chunk_sizes(total, WORKERS)


def mimd(name: str, fn, total: int) -> dict[str, float]:
    serial = gc.measure(lambda: fn(total), repeats=5, name="1 worker")
    threads = gc.measure(lambda: gc.parallel_map(fn, split(total), workers=WORKERS),
                         repeats=5, name=f"{WORKERS} threads")
    procs = gc.measure(lambda: gc.parallel_map(fn, split(total), workers=WORKERS, backend="process"),
                       repeats=5, name=f"{WORKERS} processes")
    print(f"== {name}")
    print(gc.format_comparison(serial, threads, procs))
    return {"thread": gc.speedup(serial, threads), "process": gc.speedup(serial, procs)}


def main() -> int:
    cores = gc.cpu_cores()
    print(f"torch {torch.__version__}, {cores} usable cores, SIMD: {gc.cpu_capability()}, "
          f"intra-op threads while measuring: 1\n")
    if cores < WORKERS:
        print(f"NOTE: only {cores} core(s): {WORKERS} workers cannot run in parallel here")
    with gc.intra_op_threads(1):         # one core per worker; also keeps OpenMP out of the way
        vectorisation()
        py = mimd(f"2) pure-Python work: python_work({PYTHON_STEPS:,})", gc.python_work, PYTHON_STEPS)
        tw = mimd(f"3) torch work: torch_work({TORCH_PRODUCTS:,}) of 128x128 products",
                  gc.torch_work, TORCH_PRODUCTS)
    ok_torch = tw["thread"] >= 1.6
    ok_python = 0.8 <= py["thread"] <= 1.2
    print()
    print(f"torch work, {WORKERS} threads:       {tw['thread']:.2f}x  (target >= 1.6x): "
          f"{'MET' if ok_torch else 'NOT MET'}")
    print(f"pure-Python work, {WORKERS} threads: {py['thread']:.2f}x  (target ~1x, 0.8-1.2x): "
          f"{'MET' if ok_python else 'NOT MET'}")
    print(f"pure-Python work, {WORKERS} processes: {py['process']:.2f}x  (processes escape the GIL)")
    print(f"torch work, {WORKERS} processes:     {tw['process']:.2f}x")
    return 0 if ok_torch and ok_python else 1      # non-zero exit: a target is NOT MET


if __name__ == "__main__":
    sys.exit(main())
