"""Hidden checks: every exercise has one, ``exercises/`` never shows them, and each is worth having.

A hidden check (a code cell tagged ``hidden`` right after an exercise's visible check, first line
``# Hidden NN.k — …``) tests what the visible check does not. The proof that it does: for every
exercise, a plausible wrong answer (``WRONG_ANSWERS``) that passes the visible check and fails the
hidden one. By default one per chapter is planted (``PLANTED``): only the chapter's setup cells and
that exercise's cells run, in a fresh kernel, with ``random`` seeded so the visible check is
deterministic. ``GPUCOURSE_ALL_PLANTED=1`` plants every exercise's (one whole notebook per chapter).
"""

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from gpucourse.grading.check import run_notebook
from gpucourse.grading.exercises import (
    BEGIN,
    END,
    EXERCISE_HEADING,
    HIDDEN_HEADER,
    HIDDEN_TAG,
    ExerciseFormatError,
    exercise_index,
    generate_exercises,
    make_exercise_notebook,
)

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))


def _tags(cell):
    return cell.get("metadata", {}).get("tags", [])


# --- the generator drops hidden checks -------------------------------------------------------

def test_make_exercise_notebook_drops_hidden_cells():
    nb = new_notebook(cells=[
        new_markdown_cell("## Exercise 99.1 — double"),
        new_code_cell(f"def double(x):\n    {BEGIN}\n    return 2 * x\n    {END}"),
        new_code_cell("# Check 99.1 — double\nassert double(2) == 4", metadata={"tags": ["check"]}),
        new_code_cell("# Hidden 99.1 — negative numbers\nassert double(-3) == -6",
                      metadata={"tags": [HIDDEN_TAG]}),
    ])
    index = exercise_index(nb)
    assert index["99.1"].hidden_cells == [3]
    out = make_exercise_notebook(nb)
    assert len(out.cells) == 3 and out.cells[-1].source.startswith("# Check 99.1")


@pytest.mark.parametrize("source, tags, msg", [
    ("# Hidden 99.2 — x\nassert 1", [HIDDEN_TAG], "hidden check for 99.2 inside exercise 99.1"),
    ("# Hidden 99.1 — x\nassert 1", [], "not tagged 'hidden'"),
    ("assert 1", [HIDDEN_TAG], "must start with '# Hidden NN.k"),
    ("# Hidden 99.1 — x\nassert 1", [HIDDEN_TAG, "check"], "both 'check' and 'hidden'"),
])
def test_hidden_cell_conventions_are_enforced(source, tags, msg):
    nb = new_notebook(cells=[
        new_markdown_cell("## Exercise 99.1 — double"),
        new_code_cell(f"def double(x):\n    {BEGIN}\n    return 2 * x\n    {END}"),
        new_code_cell("# Check 99.1 — double\nassert double(2) == 4", metadata={"tags": ["check"]}),
        new_code_cell(source, metadata={"tags": tags}),
    ])
    with pytest.raises(ExerciseFormatError, match=re.escape(msg)):
        exercise_index(nb)


@pytest.mark.parametrize("path", EXERCISES, ids=[p.name for p in EXERCISES])
def test_shipped_exercises_contain_no_hidden_check(path):
    nb = nbformat.read(path, as_version=4)
    for index, cell in enumerate(nb.cells):
        assert HIDDEN_TAG not in _tags(cell), f"{path.name} cell {index} is tagged 'hidden'"
        assert "# Hidden" not in cell.source, f"{path.name} cell {index} contains '# Hidden'"
        assert "hidden passed" not in str(cell.get("outputs", "")), f"{path.name} cell {index}"


def test_generated_exercises_contain_no_hidden_check(tmp_path):
    generate_exercises(ROOT / "solutions", tmp_path)
    for path in sorted(tmp_path.glob("*.ipynb")):
        text = path.read_text(encoding="utf-8")
        assert "# Hidden" not in text and '"hidden"' not in text, path.name


# --- every exercise has a hidden check --------------------------------------------------------

@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.name for p in SOLUTIONS])
def test_every_exercise_has_a_hidden_check_after_its_visible_check(path):
    nb = nbformat.read(path, as_version=4)
    for ex in exercise_index(nb, name=path.name).values():
        assert ex.hidden_cells, f"{path.name}: exercise {ex.id} has no hidden check"
        assert min(ex.hidden_cells) > ex.check_cells[0], f"{path.name}: {ex.id} hidden before check"
        for i in ex.hidden_cells:
            source = nb.cells[i].source
            assert HIDDEN_HEADER.match(source.splitlines()[0])["title"].strip(), (
                f"{path.name} cell {i}: say what the hidden check tests")
            assert f'print("{ex.id} hidden passed ✓")' in source, f"{path.name} cell {i}"
            outputs = "".join(o.get("text", "") for o in nb.cells[i].get("outputs", []))
            assert f"{ex.id} hidden passed ✓" in outputs, (
                f"{path.name} cell {i}: stored output does not show the hidden check passing "
                "(re-execute the solutions notebook)")


# --- each chapter: a planted wrong answer passes the visible check, fails the hidden one ------

#: For every exercise, a plausible wrong answer that passes its visible check and fails its hidden
#: check: it replaces the body of the solution region (a list: one entry per region, None keeps
#: the region). The per-chapter test plants one of them (PLANTED); set GPUCOURSE_ALL_PLANTED=1 to
#: plant all of a chapter's at once (about as long as running the solutions notebook).
WRONG_ANSWERS = {
    "00.1": """\
parts = [torch.zeros(5) for _ in range(dist.get_world_size())]   # the check's shape, hard-coded
dist.all_gather(parts, tensor)
tensor.copy_(torch.stack(parts).mean(0))
return tensor
""",
    "00.2": "return [int(x) for x in spec.split(',')][logical]      # cuda:-1 gives the last GPU",
    "01.1": 'return torch.stack([((x - yj) ** 2).sum(1) for yj in y], 1) if len(y) else torch.zeros(len(x), 0, dtype=x.dtype)',
    "01.2": """\
chunks = [items[w::workers] for w in range(workers)]          # round-robin, not contiguous
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
    "01.3": """\
if s > 0 and target >= 1 / s:                   # checked before target <= 1
    return None
if target <= 1:
    return 1
n = max(1, math.ceil((1 - s) / (1 / target - s)))
while 1 / (s + (1 - s) / n) < target:
    n += 1
while n > 1 and 1 / (s + (1 - s) / (n - 1)) >= target:
    n -= 1
return n
""",
    "01.4": """\
t1 = list(times.values())[0]                    # assumes n = 1 comes first
xs = [1 - 1 / n for n in times]
ys = [times[n] / t1 - 1 / n for n in times]
s = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
return min(1.0, max(0.0, s))
""",
    "02.1": """\
import math
step = math.ceil(batch_size / num_devices)
return [min(step, batch_size - start) for start in range(0, batch_size, step)]
""",
    "02.2": """\
if sum(chunk_sizes) != x.shape[dim]:
    raise ValueError(f"chunk sizes {chunk_sizes} do not add up to {x.shape[dim]}")
pieces, start = [], 0
for size in chunk_sizes:
    if size:
        index = [slice(None)] * dim + [slice(start, start + size)]   # wrong for dim < 0
        pieces.append(x[tuple(index)])
    start += size
return pieces
""",
    "02.3": """\
first = outputs[0]
if isinstance(first, torch.Tensor):
    return torch.cat(list(outputs), dim=dim)
if isinstance(first, dict):
    return {key: gather_outputs([o[key] for o in outputs], dim) for key in first}
return tuple(gather_outputs(list(parts), dim) for parts in zip(*outputs))
""",
    "02.4": """\
chunks = gc.scatter(x, devices)
used = devices[:len(chunks)]
replicas = gc.replicate(model, used)
outputs = gc.parallel_apply(replicas, chunks, used)
return torch.cat(outputs)
""",
    "03.1": """\
if not 0 <= gpu0_bsz <= batch_size:
    raise ValueError(f"gpu0_bsz must be in [0, {batch_size}], got {gpu0_bsz}")
rest = batch_size - gpu0_bsz
base = int(rest / (num_devices - 1))            # float division
extra = rest - base * (num_devices - 1)
return [gpu0_bsz] + [base + (1 if i < extra else 0) for i in range(num_devices - 1)]
""",
    "03.2": """\
model.zero_grad()                               # "start clean" — but the caller owns the gradients
total = 0.0
for xc, yc in zip(x.chunk(acc_grad), y.chunk(acc_grad)):
    loss = F.cross_entropy(model(xc), yc) * (len(xc) / len(x))
    loss.backward()
    total += loss.item()
return total
""",
    "03.3": """\
def peak(gpu0):
    sizes = gc.balanced_chunk_sizes(batch_size, gpu0, num_devices)
    return max([fixed0 + per_row * sizes[0]] + [fixed_other + per_row * s for s in sizes[1:]])

return min(range(batch_size), key=lambda g: (peak(g), -g))     # off by one: never batch_size
""",
    "03.4": """\
(x,) = inputs
sizes = gc.balanced_chunk_sizes(x.shape[0], self.gpu0_bsz, len(device_ids))
chunks = gc.scatter(x, device_ids, chunk_sizes=sizes)
used = [d for d, s in zip(device_ids, sizes) if s > 0]
return [(c,) for c in chunks], [{} for _ in used], used
""",
    "04.1": """\
if shuffle:
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    order = torch.randperm(n, generator=g).tolist()
else:
    order = list(range(n))
per_rank = n // num_replicas if drop_last else -(-n // num_replicas)
total = per_rank * num_replicas
if drop_last:
    order = order[:total]
else:
    order = (order * -(-total // n))[:total]     # divides by n: an empty dataset crashes
return order[rank:total:num_replicas]
""",
    "04.2": """\
rank, p = dist.get_rank(), dist.get_world_size()
if p == 1:
    return tensor
right, left = (rank + 1) % p, (rank - 1) % p
chunks = tensor.tensor_split(p)
for s in range(p - 1):
    send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
    buf = torch.empty(recv.shape, dtype=torch.float64)     # the check's dtype, hard-coded
    requests = [dist.isend(send, right), dist.irecv(buf, left)]
    for req in requests:
        req.wait()
    recv.add_(buf)
for s in range(p - 1):
    send, recv = chunks[(rank + 1 - s) % p], chunks[(rank - s) % p]
    requests = [dist.isend(send, right), dist.irecv(recv, left)]
    for req in requests:
        req.wait()
return tensor
""",
    "04.3": """\
world_size = dist.get_world_size()

def average(param):
    dist.all_reduce(param.grad)
    param.grad /= world_size

for layer in model.modules():                   # only the Linear layers' weights and biases
    if isinstance(layer, nn.Linear):
        for param in (layer.weight, layer.bias):
            if param is not None:
                param.register_post_accumulate_grad_hook(average)
return model
""",
    "04.4": ['return per_device_batch * nproc_per_node * nnodes * accumulation_steps', """\
import numpy as np
per_rank = dataset_size // world_size if drop_last else np.ceil(dataset_size / world_size)
return np.ceil(per_rank / per_device_batch)
""", 'return base_lr * batch / base_batch'],
    "05.1": """\
table = torch.arange(nnodes * nproc_per_node).view(nnodes, nproc_per_node)
return nnodes * nproc_per_node, table
""",
    "05.2": """\
missing = [k for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID") if k not in environ]
if missing:
    raise ValueError(f"SLURM environment is missing {', '.join(missing)}")
if "MASTER_ADDR" in environ:
    addr = environ["MASTER_ADDR"]
else:                                           # "prefix[a,b,...]" -> prefix + a
    prefix, _, rest = environ["SLURM_JOB_NODELIST"].partition("[")
    addr = prefix + rest.split(",")[0].rstrip("]")
port = int(environ["MASTER_PORT"]) if "MASTER_PORT" in environ else 15000 + int(environ["SLURM_JOB_ID"]) % 10000
return gc.DistEnv(rank=int(environ["SLURM_PROCID"]), local_rank=int(environ["SLURM_LOCALID"]),
                  world_size=int(environ["SLURM_NTASKS"]), master_addr=addr, master_port=port,
                  node_rank=int(environ["SLURM_NODEID"]),
                  nproc_per_node=int(environ["SLURM_NTASKS_PER_NODE"]),
                  nnodes=int(environ["SLURM_NNODES"]), source="slurm")
""",
    "05.3": """\
beta = (times[-1] - times[0]) / (sizes[-1] - sizes[0])      # the line through two points
return times[0] - beta * sizes[0], beta
""",
    "05.4": """\
p = torch.arange(1, 65)                         # vectorised — in float32
ring = 2 * (p - 1) * alpha + 2 * (p - 1) / p * grad_bytes * beta
efficiency = compute_s / (compute_s + ring)
return int(p[efficiency >= min_efficiency].max())
""",
    "05.5": """\
return {"backend": "gloo", "init_method": f"tcp://{master_addr}:29500",
        "rank": node_rank * gpus_per_node + local_rank, "world_size": nnodes * gpus_per_node}
""",
    "06.1": """\
if found_inf:
    return scale * backoff_factor, 0
growth_tracker += 1
if growth_tracker == growth_interval:
    grown = scale * growth_factor
    if grown < torch.finfo(torch.float32).max:  # off by one at the boundary: max itself is finite
        scale = grown
    return scale, 0
return scale, growth_tracker
""",
    "06.2": """\
finite = True
with torch.no_grad():
    for p in optimizer.param_groups[0]["params"]:     # only the first group
        finite &= bool(torch.isfinite(p.grad).all())
        p.grad.mul_(1.0 / scale)
if finite:
    optimizer.step()
return finite
""",
    "06.3": """\
optimizer.zero_grad()
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = F.mse_loss(model(x), y)
scaler.scale(loss).backward()
scaler.unscale_(optimizer)
norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
optimizer.step()                                # the gradients are unscaled now, so step directly
scaler.update()
return float(norm)
""",
    "06.4": """\
bias = 2 ** (e - 1) - 1
return {"max": (2 - 2 ** -m) * 2 ** bias, "smallest_normal": 2 ** (1 - bias),
        "smallest_subnormal": 2 ** (1 - bias - m), "eps": 2 ** -m}
""",
    "07.1": """\
n = len(costs)
if num_stages > n:
    raise ValueError(f"cannot cut {n} layers into {num_stages} stages")

def split_at(limit):                            # greedy cuts: no stage above limit, none empty
    sizes, start, current = [], 0, 0
    for i, c in enumerate(costs):
        if i > start and (current + c > limit or n - i < num_stages - len(sizes)):
            sizes.append(i - start)
            start, current = i, 0
        current += c
    return sizes + [n - start]

lo, hi = max(costs), sum(costs)                 # binary search on an integer limit
while lo < hi:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if len(split_at(mid)) <= num_stages else (mid + 1, hi)
sizes = split_at(lo)
while len(sizes) < num_stages:                  # split the largest stage until there are enough
    i = max(range(len(sizes)), key=lambda j: sizes[j])
    sizes[i:i + 1] = [1, sizes[i] - 1]
return sizes
""",
    "07.2": """\
slots = 2 * (m + p - 1)
grid = [["."] * slots for _ in range(p)]
backwards = sorted(f"B{i}" for i in range(m))   # sorts as text: B10 before B2
for s in range(p):
    for i in range(m):
        grid[s][i + s] = f"F{i}"
    for k, label in enumerate(backwards):
        grid[s][(m + p - 1) + (p - 1 - s) + k] = label
return grid
""",
    "07.3": """\
for xb, yb in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)):
    loss = F.cross_entropy(model(xb), yb) * (len(xb) / len(x))
    loss.backward()                             # never zeroes: adds to what was there
return [p.grad for p in model.parameters()]
""",
    "07.4": [None, """\
if "B0" not in ops:
    return len(ops)
return ops.index("B0")                          # forwards before the first backward
"""],
    "07.5": """\
with torch.no_grad():
    sizes = [len(c) for c in torch.tensor_split(x, chunks)]
    if rank == 0:
        for xb in torch.tensor_split(x, chunks):
            dist.send(stage(xb).contiguous(), dst=1)
        return None
    outputs = []
    for size in sizes:
        buffer = torch.empty(size, 12)          # the width of the check's model
        dist.recv(buffer, src=0)
        outputs.append(stage(buffer))
    return torch.cat(outputs)
""",
    "09.1": [None, None, None, """\
grad = grad.contiguous().clone()                # "conjugate" read as "the same": g's backward sums too
dist.all_reduce(grad)
return grad
"""],
    "09.2": ["""\
per_rank = -(-linear.out_features // world_size)      # ceil: the last rank takes what is left
rows = slice(rank * per_rank, (rank + 1) * per_rank)
self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
self.bias = nn.Parameter(linear.bias.detach()[rows].clone())
""", None],
    "09.3": """\
sum_exp = gc.reduce_from_tensor_parallel(logits_shard.exp().sum(dim=-1))   # no max: exp overflows
local = target - start
mine = (local >= 0) & (local < logits_shard.shape[-1])
picked = logits_shard.gather(-1, local.clamp(0, logits_shard.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
picked = gc.reduce_from_tensor_parallel(torch.where(mine, picked, torch.zeros_like(picked)))
return (sum_exp.log() - picked).mean()
""",
    "09.4": ["""\
dp_rank, tp_rank = divmod(rank, dp)             # tp and dp swapped
return tp_rank, dp_rank
""", """\
dp_rank = rank // dp
return [dp_rank * dp + t for t in range(dp)]
"""],
    "09.5": "return 4 * layers * batch * seq * hidden * dtype_bytes   # even when tp = 1",
    "11.1": """\
total = torch.exp(lse_a) + torch.exp(lse_b)     # no max subtracted: exp overflows for large scores
w_a, w_b = (torch.exp(lse_a) / total).unsqueeze(-1), (torch.exp(lse_b) / total).unsqueeze(-1)
return out_a * w_a + out_b * w_b, torch.log(total)
""",
    "11.2": """\
source = (rank + step) % world_size             # the ring turned the wrong way (same at 2 ranks)
return (source,) if layout == "contiguous" else (source, 2 * world_size - 1 - source)
""",
    "11.3": """\
n = 2 * world_size                              # no check: chunk() silently makes uneven chunks
chunks = x.chunk(n, dim=2)
return torch.cat([chunks[rank], chunks[n - 1 - rank]], dim=2)
""",
}

#: chapter -> the exercise planted by the per-chapter test (cheap: no multi-process visible check)
PLANTED = {"00": "00.2", "01": "01.2", "02": "02.2", "03": "03.3", "04": "04.1", "05": "05.4",
           "06": "06.1", "07": "07.4",
           "09": "09.4", "11": "11.2"}


def _plant(source: str, answers: list) -> str:
    """Replace the k-th solution region of ``source`` by ``answers[k]`` (None keeps the region)."""
    out, inside, keep, k = [], False, False, 0
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            keep = answers[k] is None
            if not keep:
                out.extend(indent + l if l else l for l in answers[k].splitlines())
            k += 1
        elif stripped == END:
            inside = False
        elif not inside or keep:
            out.append(line)
    assert k == len(answers), f"{k} solution regions, {len(answers)} answers"
    return "\n".join(out)


def planted_notebook(path: Path, plants: dict, *, only_planted: bool = True, seed: int = 0):
    """``path`` with the solution of each exercise in ``plants`` replaced by its wrong answer, and
    ``random.seed(seed)`` after the setup cells (so that the visible checks are deterministic).

    With ``only_planted`` the notebook keeps just the setup cells (code before the first exercise)
    and the planted exercises' cells. Returns the notebook and ``{id: (check cell, hidden cell)}``.
    """
    nb = nbformat.read(path, as_version=4)
    index = exercise_index(nb, name=path.name)
    headings = {m["id"]: i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
                for m in [EXERCISE_HEADING.search(c.source)] if m}
    first = min(headings.values())
    keep = set(range(first)) if only_planted else set(range(len(nb.cells)))
    for ex_id in plants:
        keep |= set(range(headings[ex_id], max(index[ex_id].hidden_cells) + 1))
    cells, where = [], {}
    for i, cell in enumerate(nb.cells):
        if i == first:
            cells.append(new_code_cell(f"import random\nrandom.seed({seed})"))
        if i not in keep or cell.cell_type != "code":
            continue
        owner = next((e for e in plants if i in index[e].solution_cells), None)
        if owner:
            answers = plants[owner] if isinstance(plants[owner], list) else [plants[owner]]
            cell.source = _plant(cell.source, answers)
        for ex_id in plants:
            if i == index[ex_id].check_cells[0]:
                where[ex_id] = [len(cells), None]
            if i == index[ex_id].hidden_cells[0]:
                where[ex_id][1] = len(cells)
        cells.append(cell)
    return new_notebook(cells=cells, metadata=nb.metadata), where


def _error(cell):
    err = next((o for o in cell.get("outputs", []) if o.output_type == "error"), None)
    return f"{err.ename}: {err.evalue.splitlines()[0] if err.evalue else ''}" if err else ""


def run_planted(chapter: str, plants: dict, tmp_path, **kw):
    """``{id: (visible error, hidden error)}`` of the planted answers ('' = that check passed)."""
    path = next(p for p in SOLUTIONS if p.name.startswith(chapter + "_"))
    nb, where = planted_notebook(path, plants, **kw)
    variant = tmp_path / path.name
    nbformat.write(nb, variant)
    executed, fatal = run_notebook(variant, cell_timeout=120)
    assert not fatal, fatal
    checks = {i for pair in where.values() for i in pair}
    for i, cell in enumerate(executed.cells):
        if cell.cell_type == "code" and i not in checks:
            assert not _error(cell), f"{path.name}, planted notebook cell {i}: {_error(cell)}"
    return {ex_id: (_error(executed.cells[c]), _error(executed.cells[h]))
            for ex_id, (c, h) in where.items()}


def _assert_caught(results):
    for ex_id, (visible, hidden) in results.items():
        assert not visible, f"{ex_id}: the planted answer should pass the visible check: {visible}"
        assert hidden, f"{ex_id}: the hidden check passed the planted wrong answer"


@pytest.mark.parametrize("chapter", sorted(PLANTED))
def test_planted_wrong_answer_passes_visible_fails_hidden(chapter, tmp_path):
    ex_id = PLANTED[chapter]
    _assert_caught(run_planted(chapter, {ex_id: WRONG_ANSWERS[ex_id]}, tmp_path))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("GPUCOURSE_ALL_PLANTED"),
                    reason="set GPUCOURSE_ALL_PLANTED=1 to plant every exercise's wrong answer")
@pytest.mark.parametrize("chapter", sorted(PLANTED))
def test_every_planted_wrong_answer_passes_visible_fails_hidden(chapter, tmp_path):
    plants = {e: a for e, a in WRONG_ANSWERS.items() if e.startswith(chapter + ".")}
    _assert_caught(run_planted(chapter, plants, tmp_path, only_planted=False))


#: chapters whose planted wrong answers live beside the chapter's own tests (same proof, their
#: own runner); each of those files must name every exercise id of its chapter
PLANTED_ELSEWHERE = {"08": "tests/sharding/test_ch08_exercise_checks.py",
                     "10": "tests/observability/test_ch10_exercise_checks.py"}


def test_every_exercise_has_a_planted_wrong_answer():
    ids = {e: p.name[:2] for p in SOLUTIONS for e in exercise_index(nbformat.read(p, as_version=4))}
    here = sorted(e for e, ch in ids.items() if ch not in PLANTED_ELSEWHERE)
    assert sorted(WRONG_ANSWERS) == here
    assert sorted(PLANTED) == sorted({ch for ch in ids.values()} - set(PLANTED_ELSEWHERE))
    assert all(PLANTED[c].startswith(c + ".") for c in PLANTED)
    for chapter, test_file in PLANTED_ELSEWHERE.items():
        text = (ROOT / test_file).read_text()
        missing = [e for e, ch in ids.items() if ch == chapter and f'"{e}"' not in text]
        assert not missing, f"{test_file} plants no wrong answer for {missing}"
