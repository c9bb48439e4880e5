"""Expert parallelism: one MoE layer (E=8, top-2) split over 2 processes vs the dense layer in 1 process.

The same tokens both ways: the dense ``gc.MoE`` runs all of them through all 8 experts in one
process; ``gc.expert_parallel`` gives each of 2 processes half of the tokens and 4 of the experts,
and moves the token copies with two all-to-alls forward and two backward. One step is forward +
backward (the input requires grad, as inside a transformer); one intra-op thread per process,
so the only parallelism is the split. The output of the first EP step is compared with the
dense one, and the bytes each rank counted with ``gc.ep_comm_bytes`` of its routed counts.

``expert_benchmark()`` prints and returns the numbers; ``benchmarks/context_expert.py`` calls it
(target: >= 1.4x, bytes == ep_comm_bytes exactly). Run alone: ``python benchmarks/_expert_bench.py``.
"""

import functools
import sys
import time

import torch
import torch.distributed as dist

import gpucourse as gc
from _bench_targets import busy_cpu_seconds

D_MODEL, D_HIDDEN, EXPERTS, TOP_K, TOKENS = 512, 2048, 8, 2, 2048
WARMUP, TIMED, ROUNDS = 1, 3, 2


def _layer():
    torch.manual_seed(0)
    return gc.MoE(D_MODEL, D_HIDDEN, EXPERTS, top_k=TOP_K)


def _tokens():
    return torch.randn(TOKENS, D_MODEL, generator=torch.Generator().manual_seed(1))


def _step(layer, x):
    if dist.is_initialized():
        dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    y = layer(x)
    y.square().mean().backward()
    elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu])
    if dist.is_initialized():
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)        # the slowest rank sets the pace
    layer.zero_grad(set_to_none=True)
    return elapsed.tolist(), y.detach()


def _worker(rank, world_size, how):
    torch.set_num_threads(1)
    x = _tokens()
    if how == "dense":
        layer = _layer()
    else:
        layer = gc.expert_parallel(_layer())
        x = torch.tensor_split(x, world_size)[rank]
    x = x.clone().requires_grad_()
    times, cpu, first, comm = [], [], None, []
    for i in range(WARMUP + TIMED):
        (t, c), y = _step(layer, x)
        times.append(t)
        cpu.append(c)
        first = y if first is None else first
        if how == "ep":
            comm.append((dict(layer.comm_bytes), layer.send_counts, layer.recv_counts))
    return {"times": times[WARMUP:], "cpu": cpu[WARMUP:], "y": first, "comm": comm}


def expert_benchmark(rounds: int = ROUNDS) -> dict:
    """Time dense vs expert-parallel MoE; check the output and the bytes. Prints and returns the numbers."""
    print(f"MoE layer: {EXPERTS} experts Linear({D_MODEL}, {D_HIDDEN}) -> GELU -> Linear, top-{TOP_K}, "
          f"{TOKENS} tokens, fp32, forward+backward; {rounds} rounds of {TIMED} timed steps; 1 thread per process")
    machine0, own0 = busy_cpu_seconds()
    dense, ep = [], []
    for _ in range(rounds):
        dense.append(gc.launch(functools.partial(_worker, how="dense"), 1, timeout=600)[0])
        ep.append(gc.launch(functools.partial(_worker, how="ep"), 2, timeout=600))
    t_dense = gc.Timing("1 process, dense MoE (8 experts)", [t for r in dense for t in r["times"]])
    t_ep = gc.Timing("2 processes, expert_parallel (4 experts each)", [t for r in ep for t in r[0]["times"]])
    print(gc.format_comparison(t_dense, t_ep))
    speed = gc.speedup(t_dense, t_ep)
    c_dense = gc.Timing("dense CPU s", [t for r in dense for t in r["cpu"]])
    c_ep = gc.Timing("EP CPU s", [t for r in ep for t in r[0]["cpu"]])
    cpu_ratio = c_dense.median / c_ep.median
    print(f"CPU seconds per step (busiest rank; less sensitive to a busy machine than wall time): dense "
          f"{c_dense.median:.2f} s, EP {c_ep.median:.2f} s -> {cpu_ratio:.2f}x less work per rank: "
          "the speed-up on two free cores if the all-to-alls hide — this run's ceiling (a rank's CPU seconds "
          "include its share of the all-to-alls, so EP can come out a little above it)")
    same = torch.allclose(torch.cat([r["y"] for r in ep[0]]), dense[0]["y"], atol=1e-5)
    bytes_ok, lines = True, []
    for rank, r in enumerate(ep[0]):
        for counted, send, recv in r["comm"]:
            want = gc.ep_comm_bytes(tokens=TOKENS // 2, d_model=D_MODEL, world_size=2, top_k=TOP_K,
                                    send_counts=send, recv_counts=recv, rank=rank)
            bytes_ok &= all(counted[k] == want[k] for k in want)
        lines.append(f"rank {rank}: sends {send} copies, receives {recv}; counted {counted['total']:,} B per step "
                     f"(+ {counted['counts']} B of counts), ep_comm_bytes {want['total']:,} B")
    uniform = gc.ep_comm_bytes(tokens=TOKENS // 2, d_model=D_MODEL, world_size=2, top_k=TOP_K)["total"]
    print("\n".join(lines) + f"\nuniform-routing expectation: {uniform:,} B per rank per step")
    print(f"EP output equals the dense MoE on the same tokens: {same}")
    print(f"target: EP=2 forward+backward >= 1.4x one process: {'MET' if speed >= 1.4 else 'NOT MET'} ({speed:.2f}x, "
          f"{speed / cpu_ratio:.0%} of this run's ceiling {cpu_ratio:.2f}x)")
    print(f"target: counted all-to-all bytes == ep_comm_bytes: {'MET' if bytes_ok else 'NOT MET'}")
    machine1, own1 = busy_cpu_seconds()
    foreign = None
    if machine0 is not None:
        foreign = max((machine1 - machine0) - (own1 - own0), 0.0)
        print(f"CPU used by other programs during the runs: {foreign:.1f} s of {machine1 - machine0:.1f} s"
              + ("  <- the machine was not idle: these timings are unreliable" if foreign > 5 else ""))
    return {"dense": t_dense, "ep": t_ep, "speedup": speed, "cpu_ratio": cpu_ratio, "speed_ok": speed >= 1.4, "same_output": same,
            "bytes_ok": bytes_ok, "foreign_cpu_s": foreign}


if __name__ == "__main__":
    result = expert_benchmark()
    sys.exit(0 if result["speed_ok"] and result["bytes_ok"] and result["same_output"] else 1)
