"""Chapter 12: plausible wrong answers its checks must reject (see ``_mutations.py``).

Ported from ``tests/grading/test_hidden_checks.py`` (``WRONG_ANSWERS``): 12.1 "ffn = 4h" (now
VISIBLE: any MLP width), 12.2 "split by tp even without SP" (now VISIBLE: tp > 1 in the visible
check), 12.3 "the memory limit forgotten" (now VISIBLE: limits in the visible check), 12.4 "zero
ignored" (now VISIBLE: ZeRO-3).

Issue 38: every edge idea the exercises name is in the visible checks: any MLP width (12.1), bf16 with
fp32 statistics (12.2), a limit exactly at a candidate's memory and expert parallelism (12.3), ZeRO-3,
one node and four, one sequence already hiding it (12.4); their wrong answers moved from HIDDEN to
VISIBLE. The hidden checks add only sizes and randomness (published sizes, tp = 8, larger batches,
answers past 10**4), each with a wrong answer only they catch.

``test_solutions_agree_with_the_package`` checks that the course's answers, the judge's reference,
agree with PyTorch's FLOP counter and the planner.
"""

import dataclasses
import random

import gpucourse as gc
from _mutations import chapter_tests, solutions_namespace

_LAYER = """\
rep = tp if sequence_parallel else 1
if recompute == "full":
    return {full}
replicated = {replicated}
split = {split}
return replicated + split
"""


def _layer(full="tokens * hidden * dtype_bytes // rep",
           replicated="tokens * 4 * hidden * dtype_bytes // rep + 2 * (tokens * 2 * 4 // rep)",
           split="tokens * (4 * hidden + 2 * ffn) * dtype_bytes // tp + tokens * heads * 4 // tp"):
    return _LAYER.format(full=full, replicated=replicated, split=split)


_BEST = """\
local = {local}
best = None
for m in {candidates}:
    if local % m:
        continue
    p = gc.predict(model, cluster, dataclasses.replace(config, microbatches=m), global_batch=global_batch)
    if p.memory.total {fits} limit and (best is None or p.time.total {better} best[0]):
        best = (p.time.total, m)
return None if best is None else best[1]
"""


def _best(local="global_batch // (config.dp * config.ep)", candidates="range(1, local + 1)", fits="<=",
          better="<"):
    return _BEST.format(local=local, candidates=candidates, fits=fits, better=better)


_HIDE = """\
def hidden(seqs):
    cfg = gc.ParallelConfig(dp=cluster.devices, zero={zero})
    return gc.predict(model, cluster, cfg, global_batch={batch}).time.dp == 0
hi = {start}
while not hidden(hi):
    hi *= 2
lo = hi // 2
while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if hidden(mid) else (mid, hi)
return {result}
"""


def _hide(zero="zero", batch="seqs * cluster.devices", start="1", result="hi"):
    return _HIDE.format(zero=zero, batch=batch, start=start, result=result)


VISIBLE = {
    "12.1": {
        "ffn = 4h (ported)": "return 6 * (layers * 12 * hidden * hidden + vocab * hidden) + 12 * layers * hidden * seq",
        "no head": "return 6 * layers * (4 * hidden * hidden + 2 * hidden * ffn) + 12 * layers * hidden * seq",
        "no attention term": "return 6 * (layers * (4 * hidden * hidden + 2 * hidden * ffn) + vocab * hidden)",
        "forward only": """\
return 2 * (layers * (4 * hidden * hidden + 2 * hidden * ffn) + vocab * hidden) + 4 * layers * hidden * seq
""",
        "the embedding counted as well as the head": """\
return 6 * (layers * (4 * hidden * hidden + 2 * hidden * ffn) + 2 * vocab * hidden) + 12 * layers * hidden * seq
""",
        "biases counted": """\
n = layers * (4 * hidden * hidden + 4 * hidden + 2 * hidden * ffn + ffn + hidden) + vocab * hidden
return 6 * n + 12 * layers * hidden * seq
""",
        "calls the forbidden helper": """\
spec = gc.ModelSpec(layers, hidden, 1, ffn, vocab, seq, tied_embeddings=True)
return spec.flops_per_token()
""",
    },
    "12.2": {
        "statistics and log-sum-exp in the activations' dtype": _layer(
            replicated="tokens * 4 * hidden * dtype_bytes // rep + 2 * (tokens * 2 * dtype_bytes // rep)",
            split="tokens * (4 * hidden + 2 * ffn) * dtype_bytes // tp + tokens * heads * dtype_bytes // tp"),
        "full recompute split by tp even without SP (ported)": _layer(full="tokens * hidden * dtype_bytes // tp"),
        "the norms' statistics forgotten": _layer(replicated="tokens * 4 * hidden * dtype_bytes // rep"),
        "everything split by tp": _layer(
            replicated="tokens * 4 * hidden * dtype_bytes // tp + 2 * (tokens * 2 * 4 // tp)"),
        "no log-sum-exp": _layer(split="tokens * (4 * hidden + 2 * ffn) * dtype_bytes // tp"),
        "the MLP's hidden layer once": _layer(
            split="tokens * (4 * hidden + ffn) * dtype_bytes // tp + tokens * heads * 4 // tp"),
        "calls the forbidden helper": """\
spec = gc.ModelSpec(layers=1, hidden=hidden, heads=heads, ffn=ffn, vocab=8, seq=tokens)
return gc.layer_activation_bytes(spec, micro_batch=1, tp=tp, sequence_parallel=sequence_parallel,
                                 recompute=recompute, dtype_bytes=dtype_bytes)
""",
    },
    "12.3": {
        "exactly at the limit does not fit": _best(fits="<"),
        "expert parallelism forgotten": _best(local="global_batch // config.dp"),
        "the memory limit forgotten (ported)": """\
local = global_batch // (config.dp * config.ep)
best = None
for m in range(1, local + 1):
    if local % m:
        continue
    p = gc.predict(model, cluster, dataclasses.replace(config, microbatches=m), global_batch=global_batch)
    if best is None or p.time.total < best[0]:
        best = (p.time.total, m)
return best[1]
""",
        "a tie goes to the larger m": _best(better="<="),
        "every m, not only divisors": _best().replace("    if local % m:\n        continue\n", ""),
        "never one micro-batch per sequence": _best(candidates="range(1, local)"),
        "the most micro-batches that fit": """\
local = global_batch // (config.dp * config.ep)
for m in sorted((d for d in range(1, local + 1) if local % d == 0), reverse=True):
    p = gc.predict(model, cluster, dataclasses.replace(config, microbatches=m), global_batch=global_batch)
    if p.memory.total <= limit:
        return m
return None
""",
    },
    "12.4": {
        "zero ignored (ported)": _hide(zero="0"),
        "never tries one sequence": _hide(start="2"),
        "the last count that does not hide": _hide(result="lo"),
        "doubling only": _hide().replace("while hi - lo > 1:", "while False:"),
        "sequences for the whole cluster, not per device": _hide(batch="seqs"),
        "F/B tokens, without latency or the ring": """\
import math
return max(1, math.ceil(cluster.peak_flops / cluster.inter.bandwidth / model.seq))
""",
    },
}

HIDDEN = {
    "12.1": {
        "int32 arithmetic (overflows at published sizes)": """\
n = torch.tensor(layers * (4 * hidden * hidden + 2 * hidden * ffn) + vocab * hidden, dtype=torch.int32)
return int(6 * n + 12 * layers * hidden * seq)
""",
    },
    "12.2": {
        "÷ tp as a shift by tp // 2 (log2 only up to tp = 4)": _layer(
            split="(tokens * (4 * hidden + 2 * ffn) * dtype_bytes + tokens * heads * 4) >> (tp // 2)"),
    },
    "12.3": {
        "tries at most 64 micro-batches": _best(candidates="range(1, min(local, 64) + 1)"),
    },
    "12.4": {
        "doubling capped at 2**14 sequences": _hide().replace("while not hidden(hi):",
                                                               "while not hidden(hi) and hi < 2**14:"),
    },
}

(test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
 test_trivial_answers_fail) = chapter_tests("12", VISIBLE, HIDDEN)


def test_solutions_agree_with_the_package():
    ns = solutions_namespace("12")
    rng = random.Random(0)
    # 12.1: PyTorch's FLOP counter on real TinyGPTs, any MLP width
    for layers, hidden, ffn, vocab, seq in ((1, 8, 32, 11, 5), (2, 12, 7, 40, 9), (3, 4, 50, 5, 1)):
        assert ns["flops_per_token"](layers, hidden, ffn, vocab, seq) == ns["counted_flops"](layers, hidden, ffn,
                                                                                            vocab, seq)
    # 12.2: the planner's activation terms
    for _ in range(300):
        tp = rng.choice([1, 2, 4, 8])
        heads = tp * rng.randint(1, 4)
        hidden, ffn, tokens = heads * rng.randint(1, 8), tp * rng.randint(1, 40), tp * rng.randint(1, 40)
        kw = dict(tp=tp, sequence_parallel=rng.random() < 0.5, recompute=rng.choice(["none", "full"]),
                  dtype_bytes=rng.choice([2, 4]))
        spec = gc.ModelSpec(layers=1, hidden=hidden, heads=heads, ffn=ffn, vocab=8, seq=tokens)
        assert ns["layer_bytes"](hidden, heads, ffn, tokens, **kw) == gc.layer_activation_bytes(spec, micro_batch=1,
                                                                                                **kw)
    # 12.3: brute force over gc.predict
    model = gc.ModelSpec(layers=4, hidden=1024, heads=16, ffn=4096, vocab=32000, seq=1024)
    cluster = gc.ClusterSpec(1, 8, 80e9, 1e13, intra=(5e-4, 1e10))
    config = gc.ParallelConfig(dp=4, pp=2)
    times = {m: gc.predict(model, cluster, dataclasses.replace(config, microbatches=m), global_batch=64).time.total
             for m in (1, 2, 4, 8, 16)}
    assert ns["best_microbatches"](model, cluster, config, 64, 10**15) == min(times, key=lambda m: (times[m], m))
    # 12.4: the smallest count that hides it, and one less does not
    cluster = gc.ClusterSpec(2, 4, 1e15, 1e13, inter=(1e-5, 1e9))
    for zero in (0, 3):
        n = ns["min_sequences_to_hide"](model, cluster, zero)
        cfg = gc.ParallelConfig(dp=8, zero=zero)
        assert gc.predict(model, cluster, cfg, global_batch=8 * n).time.dp == 0
        assert n == 1 or gc.predict(model, cluster, cfg, global_batch=8 * (n - 1)).time.dp > 0
