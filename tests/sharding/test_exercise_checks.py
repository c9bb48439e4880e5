"""Chapter 08's exercise checks can fail: a planted plausible wrong answer passes the visible check
and fails the hidden one (and the reference solution passes both)."""

import contextlib
import io
from pathlib import Path

import nbformat
import pytest

SOLUTIONS = Path(__file__).resolve().parents[2] / "solutions" / "08_sharded_data_parallel_exercises.ipynb"

# plausible wrong answers, each passing the visible check
WRONG = {
    "08.1": '''
def model_state_bytes(num_params, world_size, stage, k=12):      # forgets k, floats
    n = world_size
    return round(2 * num_params / (n if stage >= 3 else 1) + 2 * num_params / (n if stage >= 2 else 1)
                 + 12 * num_params / (n if stage >= 1 else 1))
''',
    "08.2": '''
def my_shard(flat, rank, world_size):                             # chunk() + pad the last one
    piece = flat.chunk(world_size)[rank]
    s = -(-flat.numel() // world_size)
    return torch.cat([piece, torch.zeros(s - piece.numel(), dtype=flat.dtype)])
''',
    "08.3": '''
def my_reduce_scatter(tensor):                                    # only right for 2 ranks
    rank = dist.get_rank()
    other = 1 - rank
    chunks = [c.contiguous() for c in tensor.chunk(2)]
    incoming = torch.empty_like(chunks[rank])
    works = [dist.irecv(incoming, other), dist.isend(chunks[other], other)]
    for w in works:
        w.wait()
    return chunks[rank] + incoming
''',
    "08.4": '''
def zero1_step(flat, flat_grad, shard, optimizer):                # sums instead of averaging
    grad = torch.empty_like(shard)
    dist.reduce_scatter_single(grad, flat_grad.contiguous())
    shard.grad = grad
    optimizer.step()
    dist.all_gather_single(flat, shard.detach().contiguous())
''',
    "08.5": '''
def choose_checkpoints(full_bytes, kept_bytes, costs, budget):    # greedy: biggest saving first
    n = len(full_bytes)
    held, chosen = sum(full_bytes), []
    for i in sorted(range(n), key=lambda i: kept_bytes[i] - full_bytes[i]):
        if held <= budget:
            break
        held -= full_bytes[i] - kept_bytes[i]
        chosen.append(i)
    return sorted(chosen) if held <= budget else None
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
    ns = {"__name__": "__main__"}
    outcome = {}
    with contextlib.redirect_stdout(io.StringIO()):
        for cell in _cells():
            kind, ex = _kind(cell)
            if kind == "code":
                exec(compile(cell.source, "<cell>", "exec"), ns)
            elif ex == exercise:
                if wrong is not None and kind == "check":
                    exec(compile(wrong, "<wrong>", "exec"), ns)
                try:
                    exec(compile(cell.source, "<cell>", "exec"), ns)
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
