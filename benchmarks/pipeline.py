"""Pipeline parallelism across 2 processes vs the whole model in 1 process (1 thread each).

The model is a LayerNorm and 12 Linear(1024, 1024) layers with ReLUs (12.6M parameters), trained
with SGD on batches of 2048; the pipeline cuts it into 2 stages of 6 Linear layers each and each
batch into 8 micro-batches of 256. Both sides run in processes started by `gc.launch` with one
intra-op thread, so the only parallelism is the pipeline's. Per step the ideal speed-up of p stages and m micro-batches is p·m / (m + p − 1)
= 16/9 ≈ 1.78 (the bubble (p−1)/(m+p−1) = 1/9 ≈ 11% of each stage's time is lost).

The ceiling: 2 processes, each running its stage's share of a step (forward and backward of the 8
micro-batches, the SGD step) with no sends and no waiting for the other stage. Times the bubble's
m/(m+p−1), it is the best a pipeline can reach on this machine; the target line prints the share.

The baseline, the ceiling and the two schedules run back to back in each of 3 rounds; the speed-up is the
median over rounds (of per-round ratios of median step times), the bubble the median over all timed
steps. The script also reports how much CPU other programs used meanwhile: on a shared machine a
busy neighbour makes the numbers meaningless.

    python benchmarks/pipeline.py      # targets: >= 1.5x throughput; bubble within 25% of 1/9

Exit status: 0 when both targets are met, 1 when one is not (everything is printed either way).
"""

import functools
import statistics
import sys
import time

import torch

import gpucourse as gc
from _bench_targets import busy_cpu_seconds

WIDTH, LAYERS, BATCH, CHUNKS, STAGES = 1024, 12, 2048, 8, 2
WARMUP, TIMED = 2, 4                   # SGD steps: untimed warm-up, then timed (median)
ROUNDS = 3                             # baseline and pipelines, interleaved; median over rounds
STEPS = WARMUP + TIMED


def make_model():
    torch.manual_seed(0)
    # LayerNorm, then 12 x (Linear 1024 -> 1024) with ReLUs between. The LayerNorm has parameters,
    # so the first Linear computes the gradient of its input like every other Linear: the two
    # stages (LayerNorm + 6 Linear | 6 Linear + loss) do the same work.
    return torch.nn.Sequential(torch.nn.LayerNorm(WIDTH), *gc.MLP(*[WIDTH] * (LAYERS + 1)))


def sequential_worker(rank, world_size, x, y):
    return gc.train_sequential(make_model, x, y, steps=STEPS, lr=0.01)


def stage_alone_worker(rank, world_size, x, y):
    """The ceiling: each rank runs its stage's share of a step — forward and backward of every
    micro-batch, the SGD step — with no sends, receives or waits for the other stage. What two
    processes reach on this machine before any pipeline bubble; the slowest rank's time per step."""
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    stage = gc.split_sequential(make_model(), world_size)[rank]
    opt = torch.optim.SGD(stage.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    xs = (x if rank == 0 else torch.randn(x.shape[0], WIDTH, generator=g)).chunk(CHUNKS)
    grads = torch.randn(BATCH // CHUNKS, WIDTH, generator=g)         # what stage 0 would receive
    times = []
    for _ in range(STEPS):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for xi, yi in zip(xs, y.chunk(CHUNKS)):
            xi = xi if rank == 0 else xi.requires_grad_()               # a later stage sends its input's grad
            out = stage(xi)
            if rank == world_size - 1:
                (F.cross_entropy(out, yi) / CHUNKS).backward()
            else:
                out.backward(grads)
        opt.step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return times


def one_round(x, y):
    """Baseline and both schedules, back to back: ratios within a round share the machine's state."""
    ref = gc.launch(functools.partial(sequential_worker, x=x, y=y), 1, timeout=300)[0]
    ref["ceiling_times"] = gc.launch(functools.partial(stage_alone_worker, x=x, y=y), STAGES, timeout=300)[0]
    # measure_activations=False: no Python hook on every saved tensor (the baseline has none either)
    runs = {s: gc.run_pipeline(make_model, x, y, num_stages=STAGES, schedule=s, chunks=CHUNKS,
                               steps=STEPS, lr=0.01, timeout=300, measure_activations=False)
            for s in ("gpipe", "1f1b")}
    for s, r in runs.items():       # the pipelines trained the same model as one process did
        for k, v in ref["state_dict"].items():
            torch.testing.assert_close(r.state_dict[k], v, atol=1e-5, rtol=1e-4,
                                       msg=lambda m, k=k, s=s: f"{s}: parameter {k} differs: {m}")
    return ref, runs


def main():
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, WIDTH, (BATCH,))
    print(f"model: LayerNorm + {LAYERS} x Linear({WIDTH}, {WIDTH}); batch {BATCH}; {ROUNDS} rounds of "
          f"{TIMED} timed steps after {WARMUP} warm-up; 1 thread per process")
    machine0, own0 = busy_cpu_seconds()
    rounds = [one_round(x, y) for _ in range(ROUNDS)]
    machine1, own1 = busy_cpu_seconds()
    print("parameters after the steps equal the 1-process model's (both schedules, every round)")

    def pooled(name, times_of):
        return gc.Timing(name, [t for ref, runs in rounds for t in times_of(ref, runs)[WARMUP:]])

    t_seq = pooled("1 process, whole model", lambda ref, runs: ref["step_times"])
    timings = {s: pooled(f"{STAGES} stages, {CHUNKS} micro-batches, {s}",
                         lambda ref, runs, s=s: runs[s].step_times) for s in ("gpipe", "1f1b")}
    t_alone = pooled(f"{STAGES} processes, a stage each, no sends", lambda ref, runs: ref["ceiling_times"])
    print(gc.format_comparison(t_seq, *timings.values(), t_alone))

    ideal = gc.bubble_fraction(STAGES, CHUNKS)
    alone = statistics.median(gc.speedup(gc.Timing("", ref["step_times"][WARMUP:]),
                                         gc.Timing("", ref["ceiling_times"][WARMUP:])) for ref, runs in rounds)
    ceiling = alone * (1 - ideal)
    print(f"{t_alone.name}: {alone:.2f}x (median over rounds) — with the schedule's bubble (p-1)/(m+p-1) the "
          f"best a {STAGES}-stage pipeline can reach on this machine is {alone:.2f} x {1 - ideal:.3f} = "
          f"{ceiling:.2f}x (this run's ceiling)")
    ok_all = True
    for s, timing in timings.items():
        per_round = [gc.speedup(gc.Timing("", ref["step_times"][WARMUP:]),
                                gc.Timing("", runs[s].step_times[WARMUP:])) for ref, runs in rounds]
        ratio = statistics.median(per_round)
        timed = [t for _, runs in rounds for t in runs[s].timelines[WARMUP:]]
        bubble = statistics.median(t.bubble() for t in timed)
        per_stage = ", ".join(f"{statistics.median(t.stage_bubbles()[k] for t in timed):.1%}"
                              for k in range(STAGES))
        err = abs(bubble - ideal) / ideal
        print(f"{s}: throughput {ratio:.2f}x (median over rounds {', '.join(f'{r:.2f}' for r in per_round)};"
              f" ideal p*m/(m+p-1) = {STAGES * CHUNKS / (CHUNKS + STAGES - 1):.2f}x); bubble {bubble:.1%}"
              f" (median of {len(timed)} steps; per stage {per_stage}) vs (p-1)/(m+p-1) = {ideal:.1%}:"
              f" {err:.0%} off; peak micro-batches in flight per stage {rounds[0][1][s].peak_in_flight}")
        if s == "gpipe":
            met_speed, met_bubble = ratio >= 1.5, err <= 0.25
            ok_all = met_speed and met_bubble
            print(f"target: GPipe 2-stage/8-micro-batch throughput >= 1.5x: "
                  f"{'MET' if met_speed else 'NOT MET'} ({ratio:.2f}x, {ratio / ceiling:.0%} of the ceiling "
                  f"{ceiling:.2f}x); measured bubble within 25% "
                  f"of {ideal:.3f}: {'MET' if met_bubble else 'NOT MET'} ({bubble:.3f})")
    if machine0 is not None:
        foreign = (machine1 - machine0) - (own1 - own0)
        print(f"CPU used by other programs during the runs: {max(foreign, 0):.1f} s of "
              f"{machine1 - machine0:.1f} s"
              + ("  <- the machine was not idle: these numbers are unreliable" if foreign > 2 else ""))
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
