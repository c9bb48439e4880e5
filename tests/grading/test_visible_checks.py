"""Visible checks that catch the mistakes they are about: a plausible wrong answer must FAIL them.

``test_hidden_checks.py`` proves each hidden check is worth having (a wrong answer passes the visible
check and fails the hidden one). This file proves the other half for the exercises whose visible
check tests a mechanism rather than a value — asynchronous buckets, ``no_sync``, micro-batched
messages, a diagnosis from a real run: the typical wrong answer (a blocking all-reduce, syncing every
micro-batch, the whole batch in one message, …) fails the visible check itself. A constant answer
failing every check is ``test_exercises.py::test_trivial_answers_fail_every_check``.

One notebook per chapter: its setup cells, then every planted exercise's cells without the hidden
checks, in a fresh kernel.
"""

import nbformat
import pytest

from gpucourse.grading.selfcheck import run_notebook
from gpucourse.grading.exercises import HIDDEN_TAG

from test_hidden_checks import SOLUTIONS, _error, planted_notebook

#: exercise -> a plausible wrong answer that its VISIBLE check must reject (same format as
#: WRONG_ANSWERS: one entry per solution region, None keeps the region)
VISIBLE_WRONG = {
    # a blocking all-reduce per bucket: right values, no overlap with backward
    "04.1": [None, """\
b = self.bucket_of[id(param)]
self.ready[b] += 1
if self.ready[b] == len(self.buckets[b]):
    flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[b]])
    dist.all_reduce(flat)
    self.launched.append((b, flat, None))
""", """\
for b, flat, _ in self.launched:
    flat /= self.world_size
    offset = 0
    for p in self.buckets[b]:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()
self.launched, self.ready = [], [0] * len(self.buckets)
"""],
    # syncing every micro-batch: the right gradients, k times the communication
    "04.3": [None, """\
dist.all_reduce(param.grad)                     # ignores no_sync
param.grad /= self.world_size
""", None],
    # off by one: a bucket that exactly reaches the cap is closed one gradient early
    "04.4": ["""\
buckets, size, last = [], 0, None
for t, n in zip(ready, nbytes):
    if last is not None and size + n >= bucket_cap:
        buckets.append((size, last))
        size = 0
    size, last = size + n, t
buckets.append((size, last))
link_free = 0.0
for size, ready_at in buckets:
    link_free = max(link_free, ready_at) + alpha + beta * size
return link_free
""", None],
    # every failure read as "a collective": the rendezvous that never completes is missed
    "05.3": """\
try:
    results = gc.launch(program, world_size, init_process_group=False, timeout=30)
except gc.WorkerError as err:
    return ("collective", err.rank)
if any(len(epochs) > 1 and all(e == epochs[0] for e in epochs) for epochs in results):
    return ("set_epoch", None)
return ("ok", None)
""",
    # a whole round trip counted as one message: alpha and beta twice too large
    "05.4": ["""\
times = []
for n in sizes:
    message = torch.empty(n, dtype=torch.uint8)
    round_trips = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        if rank == 0:
            dist.send(message, dst=1)
            dist.recv(message, src=1)
        else:
            dist.recv(message, src=0)
            dist.send(message, dst=0)
        if i > 0:
            round_trips.append(time.perf_counter() - start)
    times.append(statistics.median(round_trips))
return times if rank == 0 else None
""", None],
    # the world size in LOCAL_WORLD_SIZE: env:// still meets, the script's own view is wrong
    "05.5": """\
nnodes = len(node_addrs)
world = str(nnodes * nproc_per_node)
return {"MASTER_ADDR": node_addrs[0], "MASTER_PORT": str(master_port),
        "RANK": str(node_rank * nproc_per_node + local_rank), "WORLD_SIZE": world,
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": world, "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nnodes)}
""",
    # no micro-batching: the right output from one big message
    "07.5": """\
with torch.no_grad():
    if rank == 0:
        dist.send(stage(x).contiguous(), dst=1)
        return None
    buffer = torch.empty(len(x), hidden)
    dist.recv(buffer, src=0)
    return stage(buffer)
""",
    # each micro-batch's mean loss, unweighted: chunks times the gradient
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
    losses.append(F.cross_entropy(stage(buffer), yb))
for buffer, loss in zip(buffers, losses):
    loss.backward()
    dist.send(buffer.grad.contiguous(), dst=0)
return float(sum(loss.item() for loss in losses)) / chunks
""",
}


@pytest.mark.parametrize("chapter", sorted({e[:2] for e in VISIBLE_WRONG}))
def test_plausible_wrong_answer_fails_the_visible_check(chapter, tmp_path):
    path = next(p for p in SOLUTIONS if p.name.startswith(chapter + "_"))
    plants = {e: a for e, a in VISIBLE_WRONG.items() if e.startswith(chapter + ".")}
    nb, where = planted_notebook(path, plants)
    hidden = {h for _, h in where.values()}
    checks = {c: e for e, (c, _) in where.items()}
    cells, kept_checks = [], {}
    for i, cell in enumerate(nb.cells):
        if i in hidden or HIDDEN_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        if i in checks:
            kept_checks[len(cells)] = checks[i]
        cells.append(cell)
    nb.cells = cells
    variant = tmp_path / path.name
    nbformat.write(nb, variant)
    executed, fatal = run_notebook(variant, cell_timeout=120)
    assert not fatal, fatal
    for i, cell in enumerate(executed.cells):
        if i in kept_checks:
            assert _error(cell), f"{kept_checks[i]}: the visible check passed a plausible wrong answer"
        elif cell.cell_type == "code":
            assert not _error(cell), f"{path.name}, planted notebook cell {i}: {_error(cell)}"


def test_every_listed_exercise_exists():
    from gpucourse.grading.exercises import exercise_index
    ids = {e for p in SOLUTIONS for e in exercise_index(nbformat.read(p, as_version=4))}
    assert set(VISIBLE_WRONG) <= ids, sorted(set(VISIBLE_WRONG) - ids)
