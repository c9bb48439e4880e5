"""scripts/train_nd.py counts what each rank holds; the planner predicts the same bytes; a split run
trains the same model as the single-process run (same losses)."""

import importlib.util
from pathlib import Path

import pytest

import gpucourse as gc

_spec = importlib.util.spec_from_file_location("train_nd", Path(__file__).resolve().parents[2] / "scripts" / "train_nd.py")
train_nd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_nd)

SMALL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "40", "--seq", "16", "--global-batch", "8",
         "--steps", "1"]
MOE = ["--experts", "4", "--top-k", "2"]


def run(flags, nprocs):
    return gc.launch(train_nd.worker, nprocs, args=(train_nd.parse(SMALL + flags.split()),), timeout=120)


@pytest.fixture(scope="module")
def reference():
    """The same training less split: one process (dense), two and four data-parallel ranks (MoE;
    dense for ZeRO-3), two stages."""
    return {"dense": run("", 1)[0]["losses"], "moe": run("--dp 2 " + " ".join(MOE), 2)[0]["losses"],
            "pipeline": run("--pp 2 --microbatches 2", 2)[0]["losses"],
            "pipeline_moe": run("--pp 2 --dp 2 --microbatches 2 " + " ".join(MOE), 4)[0]["losses"],
            "dp": run("--dp 2 --microbatches 2", 2)[0]["losses"],
            "moe4": run("--dp 4 " + " ".join(MOE), 4)[0]["losses"]}


@pytest.mark.parametrize("flags,cfg,same_as", [
    ("--tp 2 --recompute full", dict(tp=2, recompute="full"), None),
    ("--dp 2 --microbatches 2 --recompute selective", dict(dp=2, microbatches=2, recompute="selective"), "dp"),
    ("--tp 2 --cp 2 --recompute selective", dict(tp=2, cp=2, recompute="selective"), "dense"),
    ("--dp 2 --zero 1 --microbatches 2", dict(dp=2, zero=1, microbatches=2), None),
    ("--pp 2 --microbatches 4", dict(pp=2, microbatches=4), None),
    ("--cp 2", dict(cp=2), "dense"),
    ("--ep 2 " + " ".join(MOE), dict(ep=2), "moe"),
    ("--ep 2 --zero 1 " + " ".join(MOE), dict(ep=2, zero=1), "moe"),                  # dense sharded, experts not
    ("--dp 2 --ep 2 --zero 2 " + " ".join(MOE), dict(dp=2, ep=2, zero=2), "moe4"),    # experts sharded over dp
    ("--pp 2 --tp 2 --microbatches 2", dict(pp=2, tp=2, microbatches=2), "pipeline"),     # chapter 10's stages
    ("--pp 2 --tp 2 --microbatches 2 --recompute full", dict(pp=2, tp=2, microbatches=2, recompute="full"),
     "pipeline"),
    ("--dp 2 --zero 3 --microbatches 2", dict(dp=2, zero=3, microbatches=2), "dp"),     # tied head sharded
    ("--dp 2 --cp 2 --zero 3 --microbatches 2", dict(dp=2, cp=2, zero=3, microbatches=2), "dp"),  # over dp·cp
    ("--dp 2 --zero 3 --recompute full --microbatches 2", dict(dp=2, zero=3, microbatches=2, recompute="full"),
     "dp"),                                                            # FSDP + activation checkpointing
    ("--pp 2 --cp 2 --microbatches 2", dict(pp=2, cp=2, microbatches=2), "pipeline"),     # ring attention per stage
    ("--pp 2 --ep 2 --microbatches 2 " + " ".join(MOE), dict(pp=2, ep=2, microbatches=2), "pipeline_moe"),
])
def test_counted_bytes_match_predict(flags, cfg, same_as, request):
    ranks = run(flags, gc.ParallelConfig(**cfg).world_size)
    moe = "--experts" in flags
    spec = gc.ModelSpec(layers=2, hidden=32, heads=4, ffn=128, vocab=40, seq=16, tied_embeddings=True,
                        **(dict(experts=4, top_k=2) if moe else {}))
    pred = gc.predict(spec, gc.ClusterSpec(1, len(ranks), 1e12, 1e10), gc.ParallelConfig(**cfg, sequence_parallel=False,
                      dtype="fp32"), global_batch=8).memory
    for r in ranks:
        want = pred.stages[r["stage"]] if "stage" in r else pred.as_dict()      # a pipeline: this rank's stage
        assert r["step_time"] > 0
        for kind in ("params", "grads", "optimizer", "activations"):
            # MoE: the tokens each expert receives depend on the routing; the planner assumes an even
            # split — one rank's activations follow its routing, the mean over the ranks the even split
            tol = 0.15 if moe and kind == "activations" else 0.02
            assert r[kind] == pytest.approx(want[kind], rel=tol), (kind, r[kind], want[kind])
    if moe:                # per stage; a pipeline stage's peak is its heaviest micro-batch, hence 0.08
        for stage in {r.get("stage", 0) for r in ranks}:
            mine = [r["activations"] for r in ranks if r.get("stage", 0) == stage]
            want = pred.stages[stage]["activations"] if pred.stages else pred.activations
            assert sum(mine) / len(mine) == pytest.approx(want, rel=0.08 if "--pp" in flags else 0.03), (stage, mine, want)
    if same_as:            # the first step's loss, and the loss after one optimizer step (gradients right)
        want = request.getfixturevalue("reference")[same_as]
        for r in ranks:
            assert r["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6), (r["losses"], want)


def test_axes_not_yet_built_are_refused(capsys):
    for flags in ("--pp 2 --dp 2 --zero 3", "--dp 2 --tp 2 --zero 3", "--pp 2 --dp 2 --zero 2",
                  "--dp 2 --ep 2 --zero 3 " + " ".join(MOE),
                  "--tp 2 --experts 2"):
        with pytest.raises(SystemExit):
            train_nd.parse(SMALL + flags.split())
        assert "not supported by this version" in capsys.readouterr().err
    for flags in ("--ep 2", "--ep 3 --experts 4", "--cp 3"):                  # no experts; 3 ∤ 4; 6 ∤ 16
        with pytest.raises(SystemExit):
            train_nd.parse(SMALL + flags.split())


def test_capacity_factor_reaches_the_experts(reference):
    """Capacity is applied per rank, so ep2 drops the tokens dp2 drops: same losses; and a small
    capacity really drops some (the losses differ from the unlimited run's)."""
    flags = " ".join(MOE) + " --capacity-factor 0.5"
    ep = run("--ep 2 " + flags, 2)
    dp = run("--dp 2 " + flags, 2)
    assert {r["capacity_factor"] for r in ep + dp} == {0.5}
    assert ep[0]["losses"] == pytest.approx(dp[0]["losses"], rel=1e-5, abs=1e-6)
    assert ep[0]["losses"] != pytest.approx(reference["moe"], rel=1e-4)
    with pytest.raises(SystemExit):
        train_nd.parse(SMALL + MOE + ["--capacity-factor", "0"])


def test_selective_recomputation_drops_exactly_the_attention_cores_log_sum_exp():
    plain, selective = (run(flags, 1)[0] for flags in ("", "--recompute selective"))
    spec = gc.ModelSpec(layers=2, hidden=32, heads=4, ffn=128, vocab=40, seq=16, tied_embeddings=True)
    lse = dict(gc.activation_terms(spec, micro_batch=8, dtype_bytes=4))["log-sum-exp"]     # per layer
    assert lse > 0 and plain["activations"] - selective["activations"] == 2 * lse
    assert selective["losses"] == pytest.approx(plain["losses"], rel=1e-6)


@pytest.mark.parametrize("flags,same_as", [
    ("--ep 2", "--dp 2"),                     # experts' gradients summed over dp·cp, divided by dp·cp·ep
    ("--ep 2 --zero 1", "--dp 2"),            # ZeRO over the dense and (here unsharded) expert states
    ("--dp 2 --ep 2 --zero 2", "--dp 4"),     # experts sharded over their dp copies
    ("--pp 2 --ep 2 --microbatches 2", "--pp 2 --dp 2 --microbatches 2"),    # the same, per pipeline stage
])
def test_expert_gradients_are_scaled_right_under_sgd(flags, same_as):
    """AdamW's update hardly changes when a gradient is off by a constant factor; SGD's does, so
    the second loss catches an expert gradient that was not divided by ep."""
    sgd = " ".join(MOE) + " --optimizer sgd --lr 0.5"
    got, want = (run(f"{f} {sgd}", gc.ParallelConfig(**_axes(f)).world_size)[0]["losses"] for f in (flags, same_as))
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    assert abs(got[1] - got[0]) > 1e-3                                   # the step moved the loss ...
    assert got[1] == pytest.approx(want[1], rel=1e-5)                    # ... the same way


def _axes(flags):
    words = flags.split()
    return {w[2:]: int(n) for w, n in zip(words, words[1:]) if w in ("--dp", "--ep", "--pp", "--zero")}
