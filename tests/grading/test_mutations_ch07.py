"""Chapter 07: plausible wrong answers its checks must reject (see ``_mutations.py``).

Every edge idea the exercises name is in the visible checks (issue 38): fractional costs, no layers
and one layer per stage (07.1), two-digit labels (07.2), stale gradients, one micro-batch and one row
per micro-batch (07.3), any valid order and ``[]`` (07.4), one micro-batch and a batch of one (07.5,
07.6). Their wrong answers (integer binary search, labels sorted as text, never zeroes, index of B0)
moved from HIDDEN to VISIBLE; the hidden checks add only sizes and randomness: costs to the
microsecond, longer grids, deeper models, longer orders, other hidden widths.
"""

from _mutations import chapter_tests

_SPLIT_07_1 = """\
n = len(costs)
if num_stages > n:
    raise ValueError(n)
{body}
"""

VISIBLE = {
    "07.1": {
        "greedy with an integer binary search (fails on fractional costs)": """\
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
        "by layer count, ignoring the costs": _SPLIT_07_1.format(body="""\
q, r = divmod(n, num_stages)
return [q + (1 if s < r else 0) for s in range(num_stages)]"""),
        "calls the forbidden helper": "return gc.balanced_partition(costs, num_stages)",
        "greedy: fill each stage up to the average": _SPLIT_07_1.format(body="""\
target = sum(costs) / num_stages
sizes, current, count = [], 0, 0
for i, c in enumerate(costs):
    stages_left = num_stages - len(sizes)
    if count and (current + c > target or n - i < stages_left) and stages_left > 1:
        sizes.append(count)
        current, count = 0, 0
    current, count = current + c, count + 1
return sizes + [count]"""),
        "smallest spread (max - min), not the smallest max": _SPLIT_07_1.format(body="""\
best, best_sizes = None, None
for cuts in itertools.combinations(range(1, n), num_stages - 1):
    bounds = (0, *cuts, n)
    sums = [sum(costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    if best is None or max(sums) - min(sums) < best:
        best, best_sizes = max(sums) - min(sums), [b - a for a, b in zip(bounds[:-1], bounds[1:])]
return best_sizes"""),
        "no ValueError for too few layers": """\
n = len(costs)
best, best_sizes = None, None
for cuts in itertools.combinations(range(1, n), num_stages - 1):
    bounds = (0, *cuts, n)
    worst = max(sum(costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
    if best is None or worst < best:
        best, best_sizes = worst, [b - a for a, b in zip(bounds[:-1], bounds[1:])]
return best_sizes
""",
    },
    "07.2": {
        "labels sorted as text (B10 before B2)": """\
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
        "forwards not shifted by the stage": """\
slots = 2 * (m + p - 1)
grid = [["."] * slots for _ in range(p)]
for s in range(p):
    for i in range(m):
        grid[s][i] = f"F{i}"
        grid[s][(m + p - 1) + (p - 1 - s) + i] = f"B{i}"
return grid
""",
        "backwards last in, first out": """\
slots = 2 * (m + p - 1)
grid = [["."] * slots for _ in range(p)]
for s in range(p):
    for i in range(m):
        grid[s][i + s] = f"F{i}"
        grid[s][(m + p - 1) + (p - 1 - s) + i] = f"B{m - 1 - i}"
return grid
""",
        "every stage starts its backwards at the same slot": """\
slots = 2 * (m + p - 1)
grid = [["."] * slots for _ in range(p)]
for s in range(p):
    for i in range(m):
        grid[s][i + s] = f"F{i}"
        grid[s][(m + p - 1) + i] = f"B{i}"
return grid
""",
        "one slot too many": """\
slots = 2 * (m + p)
grid = [["."] * slots for _ in range(p)]
for s in range(p):
    for i in range(m):
        grid[s][i + s] = f"F{i}"
        grid[s][(m + p - 1) + (p - 1 - s) + i] = f"B{i}"
return grid
""",
    },
    "07.3": {
        "never zeroes: adds to stale gradients": """\
for xb, yb in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)):
    loss = F.cross_entropy(model(xb), yb) * (len(xb) / len(x))
    loss.backward()                             # never zeroes: adds to what was there
return [p.grad for p in model.parameters()]
""",
        "divides by chunks (right only for equal micro-batches)": """\
model.zero_grad(set_to_none=True)
for xb, yb in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)):
    (F.cross_entropy(model(xb), yb) / chunks).backward()
return [p.grad for p in model.parameters()]
""",
        "unweighted micro-batch means": """\
model.zero_grad(set_to_none=True)
for xb, yb in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)):
    F.cross_entropy(model(xb), yb).backward()
return [p.grad for p in model.parameters()]
""",
        "the whole batch in one forward": """\
model.zero_grad(set_to_none=True)
F.cross_entropy(model(x), y).backward()
return [p.grad for p in model.parameters()]
""",
        "torch.chunk instead of tensor_split": """\
model.zero_grad(set_to_none=True)
for xb, yb in zip(torch.chunk(x, chunks), torch.chunk(y, chunks)):
    (F.cross_entropy(model(xb), yb) * (len(xb) / len(x))).backward()
return [p.grad for p in model.parameters()]
""",
    },
    "07.4": {
        "peak = forwards before the first backward": [None, """\
if "B0" not in ops:
    return len(ops)
return ops.index("B0")                          # forwards before the first backward
"""],
        "warm-up one forward too long": ["""\
w = min(p - stage, m)
ops = [f"F{i}" for i in range(w)]
for i in range(m - w):
    ops += [f"F{w + i}", f"B{i}"]
return ops + [f"B{i}" for i in range(m - w, m)]
""", None],
        "remaining backwards in reverse": ["""\
w = min(p - stage - 1, m)
ops = [f"F{i}" for i in range(w)]
for i in range(m - w):
    ops += [f"F{w + i}", f"B{i}"]
return ops + [f"B{i}" for i in reversed(range(m - w, m))]
""", None],
        "peak = number of forwards": [None, 'return sum(op.startswith("F") for op in ops)'],
        "calls the forbidden helper": ["""\
return [str(op) for op in gc.one_f_one_b_schedule(p, m).ops[stage]]
""", None],
    },
    "07.5": {
        "the whole batch in one message": """\
with torch.no_grad():
    if rank == 0:
        dist.send(stage(x).contiguous(), dst=1)
        return None
    buffer = torch.empty(len(x), hidden)
    dist.recv(buffer, src=0)
    return stage(buffer)
""",
        "torch.chunk instead of tensor_split": """\
with torch.no_grad():
    pieces = torch.chunk(x, chunks)
    if rank == 0:
        for xb in pieces:
            dist.send(stage(xb).contiguous(), dst=1)
        return None
    outputs = []
    for xb in pieces:
        buffer = torch.empty(len(xb), hidden)
        dist.recv(buffer, src=0)
        outputs.append(stage(buffer))
    return torch.cat(outputs)
""",
        "no torch.no_grad()": """\
sizes = [len(c) for c in torch.tensor_split(x, chunks)]
if rank == 0:
    for xb in torch.tensor_split(x, chunks):
        dist.send(stage(xb).detach().contiguous(), dst=1)
    return None
outputs = []
for size in sizes:
    buffer = torch.empty(size, hidden)
    dist.recv(buffer, src=0)
    outputs.append(stage(buffer))
return torch.cat(outputs)
""",
    },
    "07.6": {
        "unweighted micro-batch means": """\
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
    losses.append(F.cross_entropy(stage(buffer), yb))
for buffer, loss in zip(buffers, losses):
    loss.backward()
    dist.send(buffer.grad.contiguous(), dst=0)
return float(sum(loss.item() for loss in losses)) / chunks
""",
        "divides by chunks (right only for equal micro-batches)": """\
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
    losses.append(F.cross_entropy(stage(buffer), yb) / chunks)
for buffer, loss in zip(buffers, losses):
    loss.backward()
    dist.send(buffer.grad.contiguous(), dst=0)
return float(sum(loss.item() for loss in losses))
""",
        "rank 0 never continues the backward": """\
xs, ys = torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)
if rank == 0:
    outputs = []
    for xb in xs:
        out = stage(xb)
        dist.send(out.detach().contiguous(), dst=1)
        outputs.append(out)
    for out in outputs:
        grad = torch.empty_like(out)
        dist.recv(grad, src=1)                  # received, but never used
    return None
buffers, losses = [], []
for xb, yb in zip(xs, ys):
    buffer = torch.empty(len(xb), hidden)
    dist.recv(buffer, src=0)
    buffer.requires_grad_()
    buffers.append(buffer)
    losses.append(F.cross_entropy(stage(buffer), yb) * (len(xb) / len(x)))
for buffer, loss in zip(buffers, losses):
    loss.backward()
    dist.send(buffer.grad.contiguous(), dst=0)
return float(sum(loss.item() for loss in losses))
""",
        "returns the loss as a tensor": """\
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
    losses.append(F.cross_entropy(stage(buffer), yb) * (len(xb) / len(x)))
for buffer, loss in zip(buffers, losses):
    loss.backward()
    dist.send(buffer.grad.contiguous(), dst=0)
return sum(loss.detach() for loss in losses)
""",
    },
}

HIDDEN = {
    "07.1": {
        "rounds the stage sums to 0.1 ms (against float noise)": _SPLIT_07_1.format(body="""\
best, best_sizes = None, None
for cuts in itertools.combinations(range(1, n), num_stages - 1):
    bounds = (0, *cuts, n)
    worst = round(max(sum(costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])), 1)
    if best is None or worst < best:
        best, best_sizes = worst, [b - a for a, b in zip(bounds[:-1], bounds[1:])]
return best_sizes"""),
    },
    "07.2": {
        "a fixed row of 32 slots, cut to length (long enough for the visible cases)": """\
grid = [["."] * 32 for _ in range(p)]
for s in range(p):
    for i in range(m):
        grid[s][i + s] = f"F{i}"
        grid[s][(m + p - 1) + (p - 1 - s) + i] = f"B{i}"
return [row[:2 * (m + p - 1)] for row in grid]
""",
    },
    "07.3": {
        "zeroes only the first and the last layer (all the visible model has)": """\
model[0].zero_grad(set_to_none=True)
model[-1].zero_grad(set_to_none=True)
for xb, yb in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)):
    (F.cross_entropy(model(xb), yb) * (len(xb) / len(x))).backward()
return [p.grad for p in model.parameters()]
""",
    },
    "07.4": {
        "peak from a fixed table of 16 micro-batches": [None, """\
alive = [False] * 16                            # enough micro-batches for the examples
peak = 0
for op in ops:
    alive[int(op[1:])] = op[0] == "F"
    peak = max(peak, sum(alive))
return peak
"""],
    },
    "07.5": {
        "hard-codes the hidden width 12": """\
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
    },
    "07.6": {
        "hard-codes the hidden width 12": """\
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
    buffer = torch.empty(len(xb), 12)           # the width of the check's model
    dist.recv(buffer, src=0)
    buffer.requires_grad_()
    buffers.append(buffer)
    losses.append(F.cross_entropy(stage(buffer), yb) * (len(xb) / len(x)))
for buffer, loss in zip(buffers, losses):
    loss.backward()
    dist.send(buffer.grad.contiguous(), dst=0)
return float(sum(loss.item() for loss in losses))
""",
    },
}

(test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
 test_trivial_answers_fail) = chapter_tests("07", VISIBLE, HIDDEN)
