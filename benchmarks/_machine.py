"""How steady this machine is: one core's speed from moment to moment, and two processes at once.

Not a benchmark (its name starts with ``_``): ``make benchmarks`` runs it before and after the others.
Every target there is a ratio of timings taken seconds apart, or interleaved in rounds. On a virtual
machine whose cores change speed from second to second (a busy neighbour on the host, turbo), the
ratios move with it, and no benchmark can see it from inside: the kernel's steal time often stays
near zero. This measures it with the simplest work there is, a pure-Python loop:

* each CPU alone: the same loop in a process pinned there, again and again — the spread is how
  much "the same work" varies, and whether one CPU is slower than the other;
* both CPUs at once, a process pinned to each — on two free cores each takes as long as alone.

    python benchmarks/_machine.py            # prints a few lines; always exits 0
"""

import multiprocessing as mp
import os
import statistics
import sys
import time

LOOP = 2_000_000          # about 50-100 ms of pure Python on a 2026 server core
STEADY = 1.25             # slowest / fastest of the same work; two at once / alone


def spin(n: int = LOOP) -> float:
    """Seconds for ``n`` additions in a Python loop (no memory traffic, no library)."""
    start = time.perf_counter()
    total = 0
    for i in range(n):
        total += i
    return time.perf_counter() - start


def _pinned(cpu, barrier, conn):
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    spin(LOOP // 10)                                         # warm
    barrier.wait()
    conn.send(spin())


def timed_on(cpus: list) -> list[float]:
    """Run the loop in one fresh process per entry of ``cpus`` (pinned there), all starting at once."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(cpus))
    pipes = [ctx.Pipe(duplex=False) for _ in cpus]
    procs = [ctx.Process(target=_pinned, args=(c, barrier, w)) for c, (_, w) in zip(cpus, pipes)]
    for p in procs:
        p.start()
    for _, w in pipes:
        w.close()                        # the child's copy alone: a child that dies gives EOFError
    times = []
    for r, _ in pipes:
        if not r.poll(60):
            raise TimeoutError("a probe process sent no time within 60 s")
        times.append(r.recv())
    for p in procs:
        p.join(10)
    return times


def steal_seconds() -> float:
    """CPU time the hypervisor gave to others while this VM wanted it (Linux /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def main(argv: list[str]) -> int:
    label = argv[1] if len(argv) > 1 else "now"
    try:
        cpus = sorted(os.sched_getaffinity(0))[:2]
    except AttributeError:                                   # not Linux: no pinning
        cpus = [None, None]
    if len(cpus) < 2:
        print(f"machine ({label}): one usable CPU; nothing runs in parallel here")
        return 0
    steal = steal_seconds()
    alone = [[] for _ in cpus]                               # per position: unpinned CPUs have no name
    together = []
    for _ in range(6):                                       # rounds: each CPU alone, then both
        for i, c in enumerate(cpus):
            alone[i] += timed_on([c])
        together.append(timed_on(cpus))
    steal = steal_seconds() - steal
    every = [t for ts in alone for t in ts]
    spread = max(every) / min(every)
    base = statistics.median(every)
    slowdown = [max(pair) / base for pair in together]
    steady = spread <= STEADY and max(slowdown) <= STEADY
    per_cpu = ", ".join(f"{'CPU ' + str(c) if c is not None else 'unpinned'}: "
                        f"{statistics.median(ts) * 1e3:.0f} ms" for c, ts in zip(cpus, alone))
    print(f"machine ({label}): the same loop alone on each CPU, 6 times: {per_cpu} "
          f"(medians); {min(every) * 1e3:.0f}-{max(every) * 1e3:.0f} ms over all (slowest "
          f"{spread:.2f}x the fastest)")
    print(f"  on both CPUs at once, 6 times: the slower took {min(slowdown):.2f}-{max(slowdown):.2f}x "
          f"the median alone (two free cores: 1.00x); steal time {steal:.2f} s")
    print("  steady: ratios below compare like with like" if steady else
          f"  NOT steady (beyond {STEADY:.2f}x): this machine's speed moves between timings, so ratio "
          "targets can miss (or pass) by chance; compare a miss with this line")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
