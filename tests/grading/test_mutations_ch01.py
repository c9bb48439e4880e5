"""Chapter 01: plausible wrong answers its checks must reject (see ``_mutations.py``).

Ported from the old suites: 01.1 "a loop over y" (test_hidden_checks), 01.2 "constant", "no overlap",
"off-by-one" (test_classic_mistakes) and "round-robin chunks" (test_hidden_checks), 01.3 "checks
target >= 1/s before target <= 1" (test_hidden_checks), 01.4 "constant", "fastest measured",
"rounded calculus", "off-by-one" (test_classic_mistakes) and "calculus, k or k + 1"
(test_hidden_checks). Every edge the exercises name (a loop, float32 kept, no rows; 0-dim and int64
items; s = 1 and targets reached exactly; fits with c = 0 or b = 0) is in the visible checks, so
those wrong answers are VISIBLE now (issue 38); the hidden checks add sizes and randomness only, and
their wrong answers are ones that only larger or noisier inputs expose."""

import pytest
from _mutations import chapter_tests

# Some of 01.2's wrong answers raise inside their own worker threads (a shape mismatch, a chunk
# missing), as a learner's would: the check must still reject them, and does. The threads' tracebacks
# are the wrong answers' own, expected here; without this pytest repeats each one as a warning
# (about 290 per run) and real warnings drown in them.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")

_THREADS = """\
chunks = {split}
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
"""

_FIT = """\
A = torch.tensor([[1.0, 1.0 / n, float(n)] for n in times], dtype=torch.float64)
t = torch.tensor([float(v) for v in times.values()], dtype=torch.float64)
a, b, c = torch.linalg.lstsq(A, t[:, None]).solution.flatten().tolist()
"""

_AMDAHL = """\
if target <= 1:
    return 1
if s > 0 and target >= 1 / s:
    return None
"""

VISIBLE = {
    "01.1": {
        "absolute differences (L1)": "return (x[:, None, :] - y[None, :, :]).abs().sum(-1)",
        "distance, not squared": "return torch.cdist(x, y)",
        "sums the wrong axis": "return ((x[:, None, :] - y[None, :, :]) ** 2).sum(1)",
        "sign slip in the expansion": "return (x * x).sum(1)[:, None] + 2 * x @ y.T + (y * y).sum(1)[None, :]",
        "transposed (m, n)": "return ((y[:, None, :] - x[None, :, :]) ** 2).sum(-1)",
        "a loop over y": ("return torch.stack([((x - yj) ** 2).sum(1) for yj in y], 1) if len(y) "
                          "else torch.zeros(len(x), 0, dtype=x.dtype)"),
        "float64 whatever the input": "x, y = x.double(), y.double()\nreturn ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)",
        # the same three torch calls at every size: the loop runs over Python lists
        "a Python loop over .tolist()": """\
xs, ys = x.tolist(), y.tolist()
out = [[sum((a - b) ** 2 for a, b in zip(r, s)) for s in ys] for r in xs]
return torch.tensor(out, dtype=x.dtype).reshape(len(xs), len(ys))
""",
        "math.dist over every pair (a loop in C, over Python floats)": """\
import itertools, math
pairs = itertools.product(x.tolist(), y.tolist())
return torch.tensor([math.dist(a, b) ** 2 for a, b in pairs], dtype=x.dtype).reshape(len(x), len(y))
""",
        "a loop over .numpy() rows": """\
a, b = x.numpy(), y.numpy()
return torch.tensor([[float(((r - s) ** 2).sum()) for s in b] for r in a], dtype=x.dtype).reshape(len(a), len(b))
""",
    },
    "01.2": {
        "constant": "return 0",
        "no overlap: start, join, start, join": """\
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
        "off-by-one: loses the first item": _THREADS.format(split="gc.split_into_chunks(items[1:], workers)"),
        "round-robin chunks": _THREADS.format(split="[items[w::workers] for w in range(workers)]"),
        "torch.chunk's sizes": _THREADS.format(
            split="[items[i:i + -(-len(items) // workers)] for i in range(0, len(items), -(-len(items) // workers))]"),
        "shared total, no lock": """\
total = None
def run(chunk):
    nonlocal total
    for x in chunk:
        y = fn(x)
        total = y if total is None else total + y    # read, add (GIL released), write: races
threads = [threading.Thread(target=run, args=(c,)) for c in gc.split_into_chunks(items, workers) if c]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=60)
return total
""",
        "fn computed in the caller, threads only add": """\
results = [fn(x) for x in items]                 # the work itself runs serially, here
chunks = gc.split_into_chunks(results, workers)
partials = [None] * len(chunks)
def run(w):
    partials[w] = sum(chunks[w])
threads = [threading.Thread(target=run, args=(w,)) for w in range(len(chunks)) if chunks[w]]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=60)
return sum(p for p in partials if p is not None)
""",
        "calls the forbidden helper": "return gc.parallel_reduce(fn, items, workers=workers, num_chunks=workers)",
        "starts from the check's shape": """\
chunks = gc.split_into_chunks(items, workers)
partials = [torch.zeros(3, dtype=torch.float64) for _ in chunks]   # the shape the examples happen to have
def run(w):
    for x in chunks[w]:
        partials[w] = partials[w] + fn(x)
threads = [threading.Thread(target=run, args=(w,)) for w in range(len(chunks)) if chunks[w]]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=60)
return sum(partials[1:], partials[0])
""",
    },
    "01.3": {
        "plain ceil, no rounding repair": _AMDAHL + "return max(1, math.ceil((1 - s) / (1 / target - s)))",
        "round, not ceil": _AMDAHL + "return max(1, round((1 - s) / (1 / target - s)))",
        "floor, not ceil": _AMDAHL + "return max(1, int((1 - s) / (1 / target - s)))",
        "target > 1/s, not >=": """\
if target <= 1:
    return 1
if s > 0 and target > 1 / s:                    # target == 1/s exactly divides by zero below
    return None
return max(1, math.ceil((1 - s) / (1 / target - s)))
""",
        "forgets s = 0": """\
if target <= 1:
    return 1
if target >= 1 / s:                             # ZeroDivisionError for a perfectly parallel job
    return None
n = max(1, math.ceil((1 - s) / (1 / target - s)))
while 1 / (s + (1 - s) / n) < target:
    n += 1
while n > 1 and 1 / (s + (1 - s) / (n - 1)) >= target:
    n -= 1
return n
""",
        "a float count": """\
if target <= 1:
    return 1
if s > 0 and target >= 1 / s:
    return None
return float(max(1, math.ceil((1 - s) / (1 / target - s))))
""",
        "checks the ceiling before target <= 1": """\
if s > 0 and target >= 1 / s:                   # s = 1, target = 1: None, but one worker reaches it
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
    },
    "01.4": {
        "constant": "return 4",
        "fastest measured": "return min(times, key=times.get)",
        "rounded calculus": "import math\n" + _FIT + "return max(1, min(max_workers, round(math.sqrt(b / c))))",
        "off-by-one: never max_workers": _FIT + "return min(range(1, max_workers), key=lambda n: a + b / n + c * n)",
        "the real-valued optimum": "import math\n" + _FIT + "return max(1.0, min(float(max_workers), math.sqrt(b / c)))",
        "calculus, k or k + 1": "import math\n" + _FIT + """\
k = max(1, min(max_workers, math.floor(math.sqrt(b / c))))     # fails when the fit gives c <= 0
return min((k, min(k + 1, max_workers)), key=lambda n: a + b / n + c * n)
""",
    },
}

HIDDEN = {
    "01.1": {
        "blocks of 64 rows (a loop past 64 rows)": """\
out = torch.empty(len(x), len(y), dtype=x.dtype)
for i in range(0, len(x), 64):                  # bounds the (rows, m, d) temporary: a loop all the same
    out[i:i + 64] = ((x[i:i + 64, None, :] - y[None, :, :]) ** 2).sum(-1)
return out
""",
        # a row loop with the kernel's call counter switched off (torch._C.DisableTorchFunction) passes the
        # visible check and fails the hidden one on the grader's clock: test_timed_checks.py grades it
    },
    "01.2": {
        "threads capped at 16 (the cores)": _THREADS.format(split="gc.split_into_chunks(items, min(workers, 16))"),
    },
    "01.3": {
        "a binary search up to 10**9 workers": _AMDAHL + """\
lo, hi = 1, 10**9                               # more workers than any job has
if 1 / (s + (1 - s) / hi) < target:
    return None
while lo < hi:
    mid = (lo + hi) // 2
    if 1 / (s + (1 - s) / mid) >= target:
        hi = mid
    else:
        lo = mid + 1
return lo
""",
    },
    "01.4": {
        "the first three timings solved exactly, not least squares": """\
counts = list(times)[:3]                        # three unknowns, three equations
A = torch.tensor([[1.0, 1.0 / n, float(n)] for n in counts], dtype=torch.float64)
t = torch.tensor([float(times[n]) for n in counts], dtype=torch.float64)
a, b, c = torch.linalg.solve(A, t).tolist()
return min(range(1, max_workers + 1), key=lambda n: a + b / n + c * n)
""",
    },
}

(test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
 test_trivial_answers_fail) = chapter_tests("01", VISIBLE, HIDDEN)
