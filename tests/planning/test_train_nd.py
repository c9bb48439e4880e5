"""scripts/train_nd.py counts what each rank holds; the planner predicts the same bytes."""

import importlib.util
from pathlib import Path

import pytest

import gpucourse as gc

_spec = importlib.util.spec_from_file_location("train_nd", Path(__file__).resolve().parents[2] / "scripts" / "train_nd.py")
train_nd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_nd)

SMALL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "40", "--seq", "16", "--global-batch", "8",
         "--steps", "1"]


@pytest.mark.parametrize("flags,cfg", [("--tp 2 --recompute full", dict(tp=2, recompute="full")),
                                       ("--dp 2 --zero 1 --microbatches 2", dict(dp=2, zero=1, microbatches=2)),
                                       ("--pp 2 --microbatches 4", dict(pp=2, microbatches=4)),
                                       ("--dp 2 --zero 3 --microbatches 2",
                                        dict(dp=2, zero=3, microbatches=2))])
def test_counted_bytes_match_predict(flags, cfg):
    a = train_nd.parse(SMALL + flags.split())
    ranks = gc.launch(train_nd.worker, 2, args=(a,), timeout=120)
    spec = gc.ModelSpec(layers=2, hidden=32, heads=4, ffn=128, vocab=40, seq=16, tied_embeddings=True)
    pred = gc.predict(spec, gc.ClusterSpec(1, 2, 1e12, 1e10), gc.ParallelConfig(**cfg, sequence_parallel=False,
                      dtype="fp32"), global_batch=8).memory
    for r in ranks:
        want = pred.stages[r["stage"]] if "stage" in r else pred.as_dict()      # a pipeline: this rank's stage
        assert r["step_time"] > 0
        for kind in ("params", "grads", "optimizer", "activations"):
            assert r[kind] == pytest.approx(want[kind], rel=0.02), (kind, r[kind], want[kind])


def test_axes_not_yet_built_are_refused(capsys):
    for flags in ("--pp 2 --tp 2", "--cp 2", "--ep 2", "--dp 2 --tp 2 --zero 3",
                  "--dp 2 --zero 3 --recompute full"):
        with pytest.raises(SystemExit):
            train_nd.parse(SMALL + flags.split())
    err = capsys.readouterr().err
    assert "chapters 10-11" in err and "--zero 3" in err
