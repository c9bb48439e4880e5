"""Chapter 10's exercise checks can fail: a planted plausible wrong answer passes the visible check
and fails the hidden one (and the reference solution passes both)."""

import contextlib
import io
import random
from pathlib import Path

import nbformat
import pytest

SOLUTIONS = (Path(__file__).resolve().parents[2] / "solutions"
             / "10_profiling_and_fault_tolerance_exercises.ipynb")

# plausible wrong answers, each passing the visible check
WRONG = {
    "10.1": '''
def hidden_share(backward, comms):                 # forgets to clamp: negative overlaps subtract
    start, end = backward
    total = sum(f - l for l, f in comms)
    return sum(min(f, end) - max(l, start) for l, f in comms) / total
''',
    "10.2": '''
def capture(model, optimizer, sampler, step):      # saves the epoch, forgets the position in it
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "epoch": sampler.epoch, "rng": gc.rng_states(), "step": step}


def restore(state, model, optimizer, sampler):
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sampler.set_epoch(state["epoch"])
    gc.set_rng_states(state["rng"])
    return state["step"]
''',
    "10.3": '''
def reads_for(rows, old_world, new_world, new_rank):   # tensor_split's sizes instead of chunk's
    def bounds(world):
        edges = [r * rows // world for r in range(world + 1)]
        return list(zip(edges[:-1], edges[1:]))
    lo, hi = bounds(new_world)[new_rank]
    reads = []
    for old_rank, (a, b) in enumerate(bounds(old_world)):
        start, stop = max(a, lo), min(b, hi)
        if start < stop:
            reads.append((old_rank, start - a, stop - a))
    return reads
''',
    "10.4": '''
def joined_gradients(per_rank):                    # divides by 2, not by the world size
    steps = max(len(g) for g in per_rank)
    return [sum(g[i] for g in per_rank if i < len(g)) / 2 for i in range(steps)]
''',
    "10.5": '''
def mesh_coords(rank, pp, dp, tp):                 # dp's size where tp's belongs: right on a cube only
    return (rank // dp) % dp, rank % tp, rank // (dp * tp)
''',
}


def _cells():
    nb = nbformat.read(SOLUTIONS, as_version=4)
    return [c for c in nb.cells if c.cell_type == "code"]


def _kind(cell):
    tags = cell.get("metadata", {}).get("tags", [])
    first = cell.source.splitlines()[0] if cell.source else ""
    if "check" in tags:
        return "check", first.split()[2]
    if "hidden" in tags:
        return "hidden", first.split()[2]
    return "code", None


def _run(exercise, wrong):
    """Run setup and solution cells, optionally replace the answer, then the exercise's checks."""
    random.seed(0)
    ns = {"__name__": "__main__"}
    outcome = {}
    with contextlib.redirect_stdout(io.StringIO()):
        for cell in _cells():
            kind, ex = _kind(cell)
            if kind == "code":
                exec(compile(cell.source, "<cell>", "exec"), ns)  # noqa: S102 - the notebook's own cells
            elif ex == exercise:
                if wrong is not None and kind == "check":
                    exec(compile(wrong, "<wrong>", "exec"), ns)  # noqa: S102 - the notebook's own cells
                try:
                    exec(compile(cell.source, "<cell>", "exec"), ns)  # noqa: S102 - the notebook's own cells
                    outcome[kind] = True
                except Exception:            # noqa: BLE001 - any failure of a check counts
                    outcome[kind] = False
    return outcome


def test_every_exercise_has_one_check_and_one_hidden_check():
    kinds = [_kind(c) for c in _cells()]
    for ex in WRONG:
        assert kinds.count(("check", ex)) == 1 and kinds.count(("hidden", ex)) == 1, ex


@pytest.mark.parametrize("exercise", sorted(WRONG))
def test_planted_wrong_answer_passes_visible_fails_hidden(exercise):
    assert _run(exercise, None) == {"check": True, "hidden": True}
    assert _run(exercise, WRONG[exercise]) == {"check": True, "hidden": False}
