"""Pipeline parallelism across 2 processes vs the whole model in 1 process (1 thread each).

The model is a LayerNorm and 8 Linear(1024, 1024) layers with ReLUs (8.4M parameters), trained with
SGD on batches of 2048; the pipeline cuts it into 2 stages of 4 Linear layers each and each batch
into 8 micro-batches of 256. Both
sides run in processes started by `gc.launch` with one intra-op thread, so the only parallelism is
the pipeline's. Per step the ideal speed-up of p stages and m micro-batches is p·m / (m + p − 1)
= 16/9 ≈ 1.78 (the bubble (p−1)/(m+p−1) = 1/9 ≈ 11% of each stage's time is lost).

    python benchmarks/pipeline.py      # targets: >= 1.5x throughput; bubble within 25% of 1/9
"""

import functools
import statistics
import sys

import torch

import gpucourse as gc

WIDTH, LAYERS, BATCH, CHUNKS, STAGES, STEPS = 1024, 8, 2048, 8, 2, 6


def make_model():
    torch.manual_seed(0)
    # LayerNorm, then 8 x (Linear 1024 -> 1024) with ReLUs between. The LayerNorm has parameters,
    # so the first Linear computes the gradient of its input like every other Linear: the two
    # stages (LayerNorm + 4 Linear | 4 Linear + loss) do the same work.
    return torch.nn.Sequential(torch.nn.LayerNorm(WIDTH), *gc.MLP(*[WIDTH] * (LAYERS + 1)))


def sequential_worker(rank, world_size, x, y):
    return gc.train_sequential(make_model, x, y, steps=STEPS, lr=0.01)


def main():
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, WIDTH, (BATCH,))
    print(f"model: LayerNorm + {LAYERS} x Linear({WIDTH}, {WIDTH}); batch {BATCH}; {STEPS - 1} timed steps "
          f"after 1 warm-up; 1 thread per process")

    ref = gc.launch(functools.partial(sequential_worker, x=x, y=y), 1, timeout=300)[0]
    t_seq = gc.Timing("1 process, whole model", ref["step_times"][1:])
    runs = {}
    for schedule in ("gpipe", "1f1b"):
        runs[schedule] = gc.run_pipeline(make_model, x, y, num_stages=STAGES, schedule=schedule,
                                         chunks=CHUNKS, steps=STEPS, lr=0.01, timeout=300)
    timings = [gc.Timing(f"{STAGES} stages, {CHUNKS} micro-batches, {s}", r.step_times[1:])
               for s, r in runs.items()]
    print(gc.format_comparison(t_seq, *timings))

    for s, r in runs.items():       # the pipelines trained the same model as one process did
        for k, v in ref["state_dict"].items():
            torch.testing.assert_close(r.state_dict[k], v, atol=1e-5, rtol=1e-4,
                                       msg=lambda m, k=k, s=s: f"{s}: parameter {k} differs: {m}")
    print("parameters after the steps equal the 1-process model's (both schedules)")

    ideal = gc.bubble_fraction(STAGES, CHUNKS)
    ok_all = True
    for timing, (s, r) in zip(timings, runs.items()):
        ratio = gc.speedup(t_seq, timing)
        bubble = r.timeline.bubble()
        per_stage = ", ".join(f"{b:.1%}" for b in r.timeline.stage_bubbles())
        err = abs(bubble - ideal) / ideal
        print(f"{s}: throughput {ratio:.2f}x (ideal {STAGES * CHUNKS / (CHUNKS + STAGES - 1):.2f}x); "
              f"bubble measured {bubble:.1%} (stages: {per_stage}) vs (p-1)/(m+p-1) = {ideal:.1%} "
              f"-> {err:.0%} off; peak in-flight micro-batches per stage {r.peak_in_flight}")
        if s == "gpipe":
            met_speed, met_bubble = ratio >= 1.5, err <= 0.25
            ok_all = met_speed and met_bubble
            print(f"target: GPipe 2-stage/8-micro-batch throughput >= 1.5x: "
                  f"{'MET' if met_speed else 'NOT MET'} ({ratio:.2f}x); measured bubble within 25% "
                  f"of {ideal:.3f}: {'MET' if met_bubble else 'NOT MET'} ({bubble:.3f})")
    spread = statistics.median(t.spread for t in [t_seq, *timings])
    print(f"(median spread of the repeats: {spread:.0%})")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
