"""Shared by the benchmarks: importable per-rank functions (torch.multiprocessing.spawn needs
importable ones) and the machine-contention reading every benchmark prints."""

import datetime
import os

import torch
import torch.distributed as dist


def one_all_reduce(rank, world_size):
    """What `launch` does per rank, written by hand for spawn: join a group, all-reduce, leave."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()


def spawn_entry(rank, world_size):
    one_all_reduce(rank, world_size)


def launch_entry(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def busy_cpu_seconds():
    """CPU time used by the whole machine, and by this process and its (finished) children.

    Two readings around a benchmark tell how much CPU *other* programs took meanwhile (machine
    minus own): the benchmarks print it, so a ratio measured on a busy machine says so.
    Returns ``(None, None)`` where ``/proc/stat`` does not exist (not Linux).
    """
    try:
        import resource

        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (ImportError, OSError):        # not Linux: contention cannot be checked
        return None, None
    machine = (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")  # user..softirq, steal
    own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    return machine, own


def keep_freed_memory() -> str:
    """Let glibc's malloc keep freed buffers for reuse instead of handing them back to the kernel.

    Every training step allocates and frees the same large buffers (autocast's bf16 weights, fp32
    gradients, activations; ZeRO-2's full gradients, which it frees after every backward). Above
    glibc's mmap threshold each one is a fresh mapping whose pages the kernel faults in and zeroes
    again in every step — time that is neither compute nor communication, and varies from run to
    run. Raising the mmap and trim thresholds keeps them in the heap, as the allocators PyTorch's
    CPU tuning guide recommends (jemalloc, tcmalloc) and a GPU's caching allocator do. Call it in
    every process whose timings are compared, before they allocate; it then applies to every
    measurement alike. Returns what was done, for the report."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(-3, 32 << 20) == 1 and libc.mallopt(-1, 1 << 30) == 1   # M_MMAP/M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        ok = False
    return ("malloc keeps freed buffers (mmap threshold 32 MB, trim threshold 1 GB)" if ok
            else "the system allocator as it is (not glibc)")
