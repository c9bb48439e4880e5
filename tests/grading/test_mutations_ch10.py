"""Chapter 10: plausible wrong answers its checks must reject (see ``_mutations.py``).

Ported from ``tests/observability/test_ch10_exercise_checks.py`` (``WRONG``): 10.1 "forgets to
clamp" (HIDDEN), 10.2 "epoch, not position" (now VISIBLE: the visible check crashes mid-epoch),
10.3 "tensor_split's sizes" (now VISIBLE: uneven row counts), 10.4 "divides by 2" (now VISIBLE:
2-4 ranks), 10.5 "cube only" (now VISIBLE: meshes whose sizes differ).

Issue 38: every edge idea the exercises name is in the visible checks: all-reduces before, after and
around backward (10.1), crashes at steps 0 and 1 and augmentation from random and NumPy (10.2), ranks
with no rows (10.3), ranks with no steps and fp64 (10.4), meshes of 1-5 dimensions (10.5); their wrong
answers moved from HIDDEN to VISIBLE. The hidden checks add only sizes and randomness (many buckets,
longer runs with Adam, huge row counts, 5-8 ranks, 6-7 dimensions), each with a wrong answer only they
catch.
"""

from _mutations import chapter_tests

_CAPTURE_RIGHT = """\
return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "sampler": sampler.state_dict(), "rng": gc.rng_states(), "step": step}
"""
_RESTORE_RIGHT = """\
model.load_state_dict(state["model"])
optimizer.load_state_dict(state["optimizer"])
sampler.load_state_dict(state["sampler"])
gc.set_rng_states(state["rng"])
return state["step"]
"""

_READS = """\
def bounds(world):
{bounds}
lo, hi = bounds(new_world)[new_rank]
reads = []
for old_rank, (a, b) in enumerate(bounds(old_world)):
    start, stop = max(a, lo), min(b, hi)
    if start < stop:
        reads.append({read})
return reads
"""


def _reads(bounds, read="(old_rank, start - a, stop - a)"):
    return _READS.format(bounds="\n".join("    " + line for line in bounds.splitlines()), read=read)


VISIBLE = {
    "10.1": {
        "ignores the start of backward": """\
start, end = backward
total = sum(f - l for l, f in comms)
return sum(max(0.0, min(f, end) - l) for l, f in comms) / total
""",
        "forgets to clamp: negative overlaps subtract (ported)": """\
start, end = backward
total = sum(f - l for l, f in comms)
return sum(min(f, end) - max(l, start) for l, f in comms) / total
""",
        "the hidden seconds, not the share": """\
start, end = backward
return sum(max(0.0, min(f, end) - max(l, start)) for l, f in comms)
""",
        "the mean of each all-reduce's share": """\
start, end = backward
shares = [max(0.0, min(f, end) - max(l, start)) / (f - l) for l, f in comms]
return sum(shares) / len(shares)
""",
        "the exposed share": """\
start, end = backward
total = sum(f - l for l, f in comms)
return 1 - sum(max(0.0, min(f, end) - max(l, start)) for l, f in comms) / total
""",
        "the span from first launch to last finish as the total": """\
start, end = backward
hidden = sum(max(0.0, min(f, end) - max(l, start)) for l, f in comms)
return hidden / (max(f for _, f in comms) - min(l for l, _ in comms))
""",
        "calls the forbidden helper": """\
trace = gc.StepTrace(backward_start=backward[0], backward_end=backward[1], synced=max(f for _, f in comms),
                     comms=[(f"bucket {i}", 0, l, f) for i, (l, f) in enumerate(comms)])
return gc.hidden_fraction(trace)
""",
    },
    "10.2": {
        "only torch's random state": ["""\
return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "sampler": sampler.state_dict(), "rng": torch.get_rng_state(), "step": step}
""", """\
model.load_state_dict(state["model"])
optimizer.load_state_dict(state["optimizer"])
sampler.load_state_dict(state["sampler"])
torch.set_rng_state(state["rng"])
return state["step"]
"""],
        "epoch, not position (ported)": ["""\
return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "epoch": sampler.epoch, "rng": gc.rng_states(), "step": step}
""", """\
model.load_state_dict(state["model"])
optimizer.load_state_dict(state["optimizer"])
sampler.set_epoch(state["epoch"])
gc.set_rng_states(state["rng"])
return state["step"]
"""],
        "no random state": ["""\
return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "sampler": sampler.state_dict(), "step": step}
""", """\
model.load_state_dict(state["model"])
optimizer.load_state_dict(state["optimizer"])
sampler.load_state_dict(state["sampler"])
return state["step"]
"""],
        "no optimizer state (momentum lost)": ["""\
return {"model": model.state_dict(), "sampler": sampler.state_dict(), "rng": gc.rng_states(), "step": step}
""", """\
model.load_state_dict(state["model"])
sampler.load_state_dict(state["sampler"])
gc.set_rng_states(state["rng"])
return state["step"]
"""],
        "resumes one step later": [_CAPTURE_RIGHT, _RESTORE_RIGHT.replace('return state["step"]',
                                                                          'return state["step"] + 1')],
        "the step as a tensor": [_CAPTURE_RIGHT.replace('"step": step', '"step": torch.tensor(step)'),
                                 _RESTORE_RIGHT],
        "calls the forbidden helper": ["""\
import os, tempfile
path = os.path.join(tempfile.mkdtemp(), "step.pt")
gc.save_training_state(path, model=model, optimizer=optimizer, step=step, sampler=sampler)
return torch.load(path, weights_only=True)
""", _RESTORE_RIGHT.replace('gc.set_rng_states(state["rng"])', 'gc.set_rng_states(state["rng"][0])')],
    },
    "10.3": {
        "only the last rank is short": _reads("""\
size = -(-rows // world)
return [(r * size, (r + 1) * size) for r in range(world - 1)] + [((world - 1) * size, rows)]"""),
        "tensor_split's sizes (ported)": _reads("""\
edges = [r * rows // world for r in range(world + 1)]
return list(zip(edges[:-1], edges[1:]))"""),
        "floor size, the last rank takes the rest": _reads("""\
size = rows // world
return [(r * size, (r + 1) * size if r < world - 1 else rows) for r in range(world)]"""),
        "global rows, not rows of the old shard": _reads("""\
size = -(-rows // world)
return [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(world)]""",
                                                          read="(old_rank, start, stop)"),
        "inclusive stop": _reads("""\
size = -(-rows // world)
return [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(world)]""",
                                 read="(old_rank, start - a, stop - a - 1)"),
        "every old rank, empty reads too": """\
def bounds(world):
    size = -(-rows // world)
    return [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(world)]
lo, hi = bounds(new_world)[new_rank]
return [(old_rank, max(a, lo) - a, max(min(b, hi), max(a, lo)) - a)
        for old_rank, (a, b) in enumerate(bounds(old_world))]
""",
    },
    "10.4": {
        "counts only the ranks that ever had a step": """\
world = sum(1 for g in per_rank if g)
steps = max(len(g) for g in per_rank)
return [sum(g[i] for g in per_rank if i < len(g)) / world for i in range(steps)]
""",
        "divides by 2 (ported)": """\
steps = max(len(g) for g in per_rank)
return [sum(g[i] for g in per_rank if i < len(g)) / 2 for i in range(steps)]
""",
        "divides by the ranks still training": """\
steps = max(len(g) for g in per_rank)
out = []
for i in range(steps):
    present = [g[i] for g in per_rank if i < len(g)]
    out.append(sum(present) / len(present))
return out
""",
        "stops with the shortest rank": """\
return [sum(step) / len(per_rank) for step in zip(*per_rank)]
""",
        "sums, no average": """\
steps = max(len(g) for g in per_rank)
return [sum(g[i] for g in per_rank if i < len(g)) for i in range(steps)]
""",
    },
    "10.5": {
        "three dimensions only": """\
(a, na), (b, nb), (c, nc) = dims
return {a: rank // (nb * nc), b: (rank // nc) % nb, c: rank % nc}
""",
        "cube only: the first dim's size everywhere (ported)": """\
coords, stride = {}, 1
for name, size in reversed(dims):
    coords[name] = (rank // stride) % size
    stride *= dims[0][1]                      # the first dim's size, not this one's: right on a cube only
return {name: coords[name] for name, _ in dims}
""",
        "the first dim varies fastest": """\
coords = {}
for name, size in dims:
    rank, coords[name] = divmod(rank, size)
return coords
""",
        "no modulo": """\
coords, stride = {}, 1
for name, size in reversed(dims):
    coords[name] = rank // stride
    stride *= size
return coords
""",
        "calls the forbidden helper": """\
table = gc.mesh_coordinates(tuple(s for _, s in dims), tuple(n for n, _ in dims))
return {name: int(c) for (name, _), c in zip(dims, table[rank])}
""",
    },
}

HIDDEN = {
    "10.1": {
        "only the first five buckets (all the visible steps have)": """\
start, end = backward
comms = comms[:5]                               # DDP's buckets of the step
total = sum(f - l for l, f in comms)
return sum(max(0.0, min(f, end) - max(l, start)) for l, f in comms) / total
""",
    },
    "10.2": {
        "saves SGD's momentum buffers by hand (the visible check's optimizer)": ["""\
return {"model": model.state_dict(),
        "momentum": [optimizer.state[p].get("momentum_buffer") for p in model.parameters()],
        "sampler": sampler.state_dict(), "rng": gc.rng_states(), "step": step}
""", """\
model.load_state_dict(state["model"])
for p, buf in zip(model.parameters(), state["momentum"]):
    if buf is not None:
        optimizer.state[p]["momentum_buffer"] = buf.clone()
sampler.load_state_dict(state["sampler"])
gc.set_rng_states(state["rng"])
return state["step"]
"""],
    },
    "10.3": {
        "ceil with a float division (wrong past 2**53 rows)": _reads("""\
import math
size = math.ceil(rows / world)
return [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(world)]"""),
    },
    "10.4": {
        "a fixed table of 6 steps (the most the visible ranks take)": """\
world = len(per_rank)
sums = [0] * 6                                  # one running sum per step
for grads in per_rank:
    for i, g in enumerate(grads):
        sums[i] = sums[i] + g
steps = max(len(g) for g in per_rank)
return [s / world for s in sums[:steps]]
""",
    },
    "10.5": {
        "pads the mesh to torchtitan's five dimensions": """\
names = [n for n, _ in dims]
sizes = [1] * (5 - len(dims)) + [s for _, s in dims]
a, b, c, d, e = sizes
coords = [rank // (b * c * d * e), rank // (c * d * e) % b, rank // (d * e) % c, rank // e % d, rank % e]
return dict(zip(names, coords[5 - len(dims):]))
""",
    },
}

(test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
 test_trivial_answers_fail) = chapter_tests("10", VISIBLE, HIDDEN)
