"""Visible checks fail the classic wrong answers: a constant, a wrong reduction, an off-by-one.

Every exercise's visible check must be able to fail. ``test_exercises.py`` proves it for ``return
None`` and ``return 0``; ``test_visible_checks.py`` plants one mechanism-level wrong answer per
exercise in a kernel. This file plants, for the exercises listed in ``CLASSIC_MISTAKES``, several
wrong answers each that a learner plausibly writes — a constant that looks right, the wrong
reduction (a mean where a sum belongs, the fastest *measured* point instead of the model's), an
off-by-one — and asserts that the visible check raises. It runs in this process (no kernel): the
chapter's setup cells, then the exercise's cells with its solution replaced, then its check cell.
"""

import contextlib
import io
from pathlib import Path

import nbformat
import pytest

from gpucourse.grading.exercises import EXERCISE_HEADING, exercise_index

from test_hidden_checks import _plant

ROOT = Path(__file__).resolve().parents[2]

#: exercise id -> {what the wrong answer gets wrong: the body of its solution region}
CLASSIC_MISTAKES = {
    "00.2": {
        "constant": "return 0",
        "negative index": """\
ids = [int(x) for x in spec.split(",") if x.strip()]
if logical >= len(ids):                         # forgets that cuda:-1 is not visible either
    raise IndexError(logical)
return ids[logical]
""",
        "off-by-one": """\
ids = [int(x) for x in spec.split(",") if x.strip()]
if not 0 <= logical < len(ids):
    raise IndexError(logical)
return ids[logical - 1]                         # cuda:1 read as 'the first GPU'
""",
    },
    "00.3": {
        "constant": 'return "gloo", [None] * nprocs',
        "filter instead of stop": """\
ids = list(range(machine_gpus)) if spec is None else [int(e) for e in spec.split(",") if e.strip()]
visible = [g for g in ids if 0 <= g < machine_gpus]     # skips a missing GPU instead of stopping there
if not visible or not nccl_built:
    return "gloo", [None] * nprocs
if nprocs > len(visible):
    raise ValueError(nprocs)
return "nccl", visible[:nprocs]
""",
        "off-by-one": """\
visible = list(range(machine_gpus)) if spec is None else []
for entry in ([] if spec is None else [e for e in spec.split(",") if e.strip()]):
    if not 0 <= int(entry) < machine_gpus:
        break
    visible.append(int(entry))
if not visible or not nccl_built:
    return "gloo", [None] * nprocs
if nprocs >= len(visible):                      # refuses one rank per GPU exactly
    raise ValueError(nprocs)
return "nccl", visible[:nprocs]
""",
    },
    "01.2": {
        "constant": "return 0",
        "no overlap": """\
chunks = gc.split_into_chunks(items, workers)
partials = [None] * len(chunks)
def run(w):
    total = None
    for x in chunks[w]:
        y = fn(x)
        total = y if total is None else total + y
    partials[w] = total
for w in range(len(chunks)):
    if chunks[w]:
        t = threading.Thread(target=run, args=(w,))
        t.start()
        t.join(timeout=60)                      # waits before starting the next: one at a time
return sum(p for p in partials if p is not None)
""",
        "off-by-one": """\
chunks = gc.split_into_chunks(items[1:], workers)     # loses the first item
partials = [None] * len(chunks)
def run(w):
    total = None
    for x in chunks[w]:
        y = fn(x)
        total = y if total is None else total + y
    partials[w] = total
threads = [threading.Thread(target=run, args=(w,)) for w in range(len(chunks)) if chunks[w]]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=60)
return sum(p for p in partials if p is not None)
""",
    },
    "01.4": {
        "constant": "return 4",
        "fastest measured": "return min(times, key=times.get)",
        "rounded calculus": """\
import math
A = torch.tensor([[1.0, 1.0 / n, float(n)] for n in times], dtype=torch.float64)
t = torch.tensor(list(times.values()), dtype=torch.float64)
a, b, c = torch.linalg.lstsq(A, t[:, None]).solution.flatten().tolist()
return max(1, min(max_workers, round(math.sqrt(b / c))))
""",
        "off-by-one": """\
A = torch.tensor([[1.0, 1.0 / n, float(n)] for n in times], dtype=torch.float64)
t = torch.tensor(list(times.values()), dtype=torch.float64)
a, b, c = torch.linalg.lstsq(A, t[:, None]).solution.flatten().tolist()
return min(range(1, max_workers), key=lambda n: a + b / n + c * n)    # never max_workers
""",
    },
    "03.1": {
        "constant": "return model",
        "mean, as DDP": """\
for i, param in enumerate(model.parameters()):
    grads = [list(r.parameters())[i].grad for r in replicas]
    grads = [g.to(param.device) for g in grads if g is not None]
    param.grad = torch.stack(grads).mean(0)
return model
""",
        "off-by-one": """\
for i, param in enumerate(model.parameters()):
    for replica in replicas[1:]:                # device 0's replica left out
        grad = list(replica.parameters())[i].grad
        if grad is not None:
            param.grad = grad.clone() if param.grad is None else param.grad + grad
return model
""",
    },
    "03.2": {
        "constant": "return [batch_size] + [0] * (len(sec_per_row) - 1)",
        "least busy now": """\
n = len(sec_per_row)
rows, finish = [0] * n, [overhead0] + [0.0] * (n - 1)
for _ in range(batch_size):
    k = min(range(n), key=lambda d: finish[d])  # the idle device, however slow
    rows[k] += 1
    finish[k] += sec_per_row[k]
return rows
""",
        "off-by-one": """\
n = len(sec_per_row)
rows, finish = [0] * n, [overhead0] + [0.0] * (n - 1)
for _ in range(batch_size - 1):
    k = min(range(n), key=lambda d: finish[d] + sec_per_row[d])
    rows[k] += 1
    finish[k] += sec_per_row[k]
rows[0] += 1 if batch_size else 0              # the last row to device 0
return rows
""",
    },
    "06.3": {
        "constant": "return 0.0",
        "clip before unscale": """\
optimizer.zero_grad()
with torch.autocast("cpu", dtype=torch.float16):
    loss = F.mse_loss(model(x), y)
scaler.scale(loss).backward()
norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)   # clips the scaled gradients
scaler.step(optimizer)
scaler.update()
return float(norm)
""",
        "bf16": """\
optimizer.zero_grad()
with torch.autocast("cpu", dtype=torch.bfloat16):   # the lesson's bf16, not the exercise's fp16
    loss = F.mse_loss(model(x), y)
scaler.scale(loss).backward()
scaler.unscale_(optimizer)
norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
scaler.step(optimizer)
scaler.update()
return float(norm)
""",
    },
}


def _solutions(chapter):
    return next((ROOT / "solutions").glob(f"{chapter}_*.ipynb"))


def _run_check(ex_id: str, answer: str) -> BaseException | None:
    """Run the chapter's setup cells and ``ex_id``'s cells (its solution replaced by ``answer``)
    up to and including its visible check, in a fresh namespace; the check's exception or None."""
    nb = nbformat.read(_solutions(ex_id[:2]), as_version=4)
    index = exercise_index(nb)[ex_id]
    headings = {m["id"]: i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
                for m in [EXERCISE_HEADING.search(c.source)] if m}
    first, start, check = min(headings.values()), headings[ex_id], index.check_cells[0]
    namespace = {"__name__": "__main__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i in [*range(first), *range(start, check)]:
            cell = nb.cells[i]
            if cell.cell_type != "code":
                continue
            source = _plant(cell.source, [answer]) if i in index.solution_cells else cell.source
            exec(compile(source, f"{ex_id} cell {i}", "exec"), namespace)
        try:
            exec(compile(nb.cells[check].source, f"{ex_id} check", "exec"), namespace)
        except Exception as err:        # noqa: BLE001 — any failure of the check counts
            return err
    return None


CASES = [(e, kind) for e, answers in CLASSIC_MISTAKES.items() for kind in answers]


@pytest.mark.parametrize("ex_id, kind", CASES, ids=[f"{e}-{k}" for e, k in CASES])
def test_visible_check_fails_a_plausible_wrong_answer(ex_id, kind):
    err = _run_check(ex_id, CLASSIC_MISTAKES[ex_id][kind])
    assert err is not None, f"{ex_id}: the visible check passed the wrong answer '{kind}'"


@pytest.mark.parametrize("ex_id", sorted(CLASSIC_MISTAKES))
def test_visible_check_passes_the_solution(ex_id):
    """The runner itself is sound: the unchanged solution passes the same way."""
    nb = nbformat.read(_solutions(ex_id[:2]), as_version=4)
    regions = sum(nb.cells[i].source.count("### BEGIN SOLUTION") for i in exercise_index(nb)[ex_id].solution_cells)
    assert regions == 1, f"{ex_id}: {regions} solution regions; this runner plants one"
    from gpucourse.grading.exercises import BEGIN, END
    cell = nb.cells[exercise_index(nb)[ex_id].solution_cells[0]].source
    body = cell.split(BEGIN, 1)[1].split(END, 1)[0]
    lines = body.splitlines()[1:-1] if body.splitlines() and not body.splitlines()[0].strip() else body.splitlines()
    indent = min(len(l) - len(l.lstrip()) for l in lines if l.strip())
    answer = "\n".join(l[indent:] for l in lines)
    assert _run_check(ex_id, answer) is None
