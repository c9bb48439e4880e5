"""A real 2-host all-reduce over a 1 Gbit/s link, against loopback and the α-β model's prediction.

Two network namespaces joined by a virtual cable capped at 1 Gbit/s (``gc.emulated_link``) act as
two machines; ``scripts/allreduce_bench.py`` runs under torchrun on each (one process per host)
and times gloo's all-reduce of several sizes. In the same run:

* baseline: the same 2-node job over loopback (no cable, no cap);
* prediction: ``gc.ring_all_reduce_time(n, 2, α, β)`` with α measured on loopback
  (``gc.measure_point_to_point``) and β = 1 / 125 MB/s (1 Gbit/s).

    python benchmarks/multi_node_1gbe.py      # Linux, root, iproute2 (ip, tc); else it skips

Target: for every size >= 1 MB the measurement is within ±25% of the model's prediction (the model
describes a bandwidth-bound link). It also prints how many times slower than loopback the link is.
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gpucourse as gc

SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
TOLERANCE = 0.25


def all_reduce_seconds(**launch_options):
    script = str(ROOT / "scripts" / "allreduce_bench.py")
    args = ["--sizes", ",".join(map(str, SIZES)), "--repeats", "5"]
    res = gc.launch_nodes(script, 2, 1, script_args=args, echo=False, timeout=300, **launch_options)
    return json.loads(res[0].by_rank()[0][-1])["seconds"]  # rank 0 prints one JSON line


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ok, reason = gc.netns_support()
    if not ok:
        print(f"SKIPPED: cannot emulate a network link here: {reason}")
        return 0
    alpha = gc.fit_alpha_beta([4, 1024, 16384], gc.measure_point_to_point([4, 1024, 16384])).alpha
    model = gc.AlphaBeta(alpha, gc.LINKS["1 GbE"].beta, "1 GbE, α from loopback")
    print(f"model: {model}")
    loopback = all_reduce_seconds()
    with gc.emulated_link(rate_mbit=1000) as link:
        slow = all_reduce_seconds(**link.launch_options())
    print(f"{'size':>7} {'loopback':>10} {'1 Gbit/s':>10} {'slowdown':>9} {'model':>10} "
          f"{'measured/model':>15}")
    worst = 0.0
    for n, fast, measured in zip(SIZES, loopback, slow):
        predicted = model.ring_all_reduce_time(n, 2)
        worst = max(worst, abs(measured / predicted - 1))
        print(f"{n >> 20:>5}MB {fast * 1e3:>8.1f}ms {measured * 1e3:>8.1f}ms {measured / fast:>8.1f}x "
              f"{predicted * 1e3:>8.1f}ms {measured / predicted:>15.2f}")
    met = worst <= TOLERANCE
    print(f"largest deviation from the model: {worst:.0%} (target <= {TOLERANCE:.0%} for sizes "
          f">= 1 MB): {'MET' if met else 'NOT MET'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
