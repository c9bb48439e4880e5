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

from gpucourse.grading.selfcheck import run_notebook
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
    "00.2": """\
ids = [int(x) for x in spec.split(",")]         # CUDA_VISIBLE_DEVICES="" (no GPU) raises ValueError
if not 0 <= logical < len(ids):
    raise IndexError(f"cuda:{logical} is not visible")
return ids[logical]
""",
    "00.3": """\
visible = list(range(machine_gpus)) if spec is None else []
for entry in ([] if spec is None else [e for e in spec.split(",") if e.strip()]):
    if int(entry) >= machine_gpus:              # stops at a missing GPU, not at "-1"
        break
    visible.append(int(entry))
if not visible or not nccl_built:
    return "gloo", [None] * nprocs
if nprocs > len(visible):
    raise ValueError(f"{nprocs} ranks, {len(visible)} GPUs")
return "nccl", visible[:nprocs]
""",
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
import math
A = torch.tensor([[1.0, 1.0 / n, float(n)] for n in times], dtype=torch.float64)
t = torch.tensor(list(times.values()), dtype=torch.float64)
a, b, c = torch.linalg.lstsq(A, t[:, None]).solution.flatten().tolist()
k = max(1, min(max_workers, math.floor(math.sqrt(b / c))))     # calculus: fails when the fit gives c <= 0
return min((k, min(k + 1, max_workers)), key=lambda n: a + b / n + c * n)
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
for i, param in enumerate(model.parameters()):
    grads = [list(r.parameters())[i].grad for r in replicas]
    grads = [g.to(param.device) for g in grads if g is not None]
    if grads:
        param.grad = torch.stack(grads).sum(0)  # overwrites: an earlier step's gradient is lost
return model
""",
    "03.2": """\
n = len(sec_per_row)                            # searches only gpu0_bsz + an even rest
if batch_size == 0:
    return [0] * n
def time_of(rows):
    return max([overhead0 + sec_per_row[0] * rows[0]] + [p * r for p, r in zip(sec_per_row[1:], rows[1:])])
return min((gc.balanced_chunk_sizes(batch_size, g, n) for g in range(batch_size + 1)), key=time_of)
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
    "04.1": [None, """\
b = self.bucket_of[id(param)]
self.ready[b] += 1
if self.ready[b] == len(self.buckets[b]):
    flat = torch.zeros(sum(p.numel() for p in self.buckets[b]))   # float32, whatever the gradients are
    offset = 0
    for p in self.buckets[b]:
        flat[offset:offset + p.numel()] = p.grad.reshape(-1)
        offset += p.numel()
    self.launched.append((b, flat, dist.all_reduce(flat, async_op=True)))
""", None],
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
    "04.3": [None, None, """\
self.sync = False                               # no try/finally: an exception leaves it off,
yield                                           # and a nested block switches it back on too early
self.sync = True
"""],
    "04.4": [None, """\
return min(caps, key=lambda cap: modelled_step_time(ready, nbytes, alpha, beta, cap))   # first in list order on a tie
"""],
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
try:
    results = gc.launch(program, world_size, init_process_group=False, timeout=30)
except gc.WorkerError as err:
    if "init_process_group" in err.remote_traceback:
        return ("world_size", None)
    return ("collective", 0)                        # "the rank under if rank == 0"
if any(len(epochs) > 1 and all(e == epochs[0] for e in epochs) for epochs in results):
    return ("set_epoch", None)
return ("ok", None)
""",
    "05.4": [None, """\
beta = (times[-1] - times[0]) / (sizes[-1] - sizes[0])      # the line through two points
return times[0] - beta * sizes[0], beta
"""],
    "05.5": """\
nnodes = len(node_addrs)
return {"MASTER_ADDR": node_addrs[0], "MASTER_PORT": master_port,          # ints, not strings
        "RANK": node_rank * nproc_per_node + local_rank, "WORLD_SIZE": nnodes * nproc_per_node,
        "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": nproc_per_node, "GROUP_RANK": node_rank,
        "GROUP_WORLD_SIZE": nnodes}
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
with torch.autocast("cpu", dtype=torch.float16):
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
    "07.6": """\
xs, ys = torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)
if rank == 0:
    outputs = []
    for xb in xs:
        out = stage(xb)
        dist.send(out.detach().contiguous(), dst=1)
        outputs.append(out)
    for out in outputs:
        grad = torch.empty_like(out)
        dist.recv(grad, src=1)
        out.backward(grad)
    return None
buffers, losses = [], []
for xb, yb in zip(xs, ys):
    buffer = torch.empty(len(xb), hidden)
    dist.recv(buffer, src=0)
    buffer.requires_grad_()
    buffers.append(buffer)
    losses.append(F.cross_entropy(stage(buffer), yb) / chunks)   # right only for equal micro-batches
for buffer, loss in zip(buffers, losses):
    loss.backward()
    dist.send(buffer.grad.contiguous(), dst=0)
return float(sum(loss.item() for loss in losses))
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
    # chapter 11 (experts)
    "11.4": """\
num_tokens, num_experts = logits.shape
weights, experts = logits.softmax(dim=-1).topk(k, dim=-1)
weights = weights / weights.sum(dim=-1, keepdim=True)
keep = torch.ones_like(experts, dtype=torch.bool)
if capacity_factor is not None:
    capacity = int(capacity_factor * num_tokens * k / num_experts)     # floor, not ceil
    used = [0] * num_experts
    for j in range(k):
        for t in range(num_tokens):
            e = int(experts[t, j])
            if used[e] < capacity:
                used[e] += 1
            else:
                keep[t, j] = False
return weights, experts, keep
""",
    "11.5": """\
world_size, num_experts = counts.shape
per_rank = num_experts // world_size                  # assumes the experts divide evenly
owner = [min(e // per_rank, world_size - 1) for e in range(num_experts)]
send = [sum(int(counts[rank, e]) for e in range(num_experts) if owner[e] == r) for r in range(world_size)]
recv = [sum(int(counts[s, e]) for e in range(num_experts) if owner[e] == rank) for s in range(world_size)]
return send, recv
""",
    "11.6": """\
rows = send[1 - rank] + recv[1 - rank]                 # "the other rank": right for 2 ranks only
one_way = rows * d_model * dtype_bytes
return {"forward": one_way, "backward": one_way, "total": 2 * one_way}
""",
    "12.1": "return 6 * (layers * 12 * hidden * hidden + vocab * hidden) + 12 * layers * hidden * seq   # ffn = 4h",
    "12.2": """\
if recompute == "full":
    return tokens * hidden * dtype_bytes // tp                 # split by tp even without SP
replicated = tokens * 4 * hidden * dtype_bytes // tp + 2 * (tokens * 2 * 4 // tp)
split = tokens * (4 * hidden + 2 * ffn) * dtype_bytes // tp + tokens * heads * 4 // tp
return replicated + split
""",
    "12.3": """\
local = global_batch // (config.dp * config.ep)
best = None
for m in range(1, local + 1):
    if local % m:
        continue
    p = gc.predict(model, cluster, dataclasses.replace(config, microbatches=m), global_batch=global_batch)
    if best is None or p.time.total < best[0]:            # the memory limit forgotten
        best = (p.time.total, m)
return best[1]
""",
    "12.4": """\
def hidden(seqs):
    cfg = gc.ParallelConfig(dp=cluster.devices)          # zero ignored: ZeRO-3's extra gathers missed
    return gc.predict(model, cluster, cfg, global_batch=seqs * cluster.devices).time.dp == 0
lo, hi = 0, 1
while not hidden(hi):
    lo, hi = hi, hi * 2
while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if hidden(mid) else (mid, hi)
return hi
""",
}

#: chapter -> the exercise planted by the per-chapter test (cheap: no multi-process visible check)
PLANTED = {"00": "00.2", "01": "01.2", "02": "02.2", "03": "03.3", "04": "04.4", "05": "05.2",
           "06": "06.1", "07": "07.4",
           "09": "09.4", "11": "11.2", "12": "12.1"}


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
