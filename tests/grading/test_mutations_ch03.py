"""Chapter 03: plausible wrong answers its checks must reject (see ``_mutations.py``).

Ported from the old suites: 03.1 "constant", "mean, as DDP", "off-by-one" (test_classic_mistakes) and
"overwrites an earlier step's gradient" (test_hidden_checks); 03.2 "constant", "least busy now",
"off-by-one" (test_classic_mistakes) and "gpu0_bsz + an even rest only" (test_hidden_checks); the old
03.3 (choose gpu0_bsz) is now 03.4, with its "off-by-one: never batch_size" (test_hidden_checks);
the old 03.4 (balanced scatter) is now 03.3, and its "keyword arguments dropped" (test_hidden_checks)
is caught by the visible check, since the text now says tensor keyword arguments are split (as
lesson 02 §4 and gc.BalancedDataParallel do) and the visible check passes a keyword argument.
Every edge the exercises name (a .grad already set, a layer no replica uses, the replicas left
untouched; unequal devices; tensor keyword arguments, the batch along dim 1, one row; device 0 the
lighter, rows for free, ties) is in the visible checks, so those wrong answers are VISIBLE now
(issue 38). The hidden checks add sizes only (more devices, larger batches): their wrong answers are
answers fitted to the visible checks' sizes.
"""

from _mutations import chapter_tests

_REDUCE = """\
for i, param in enumerate(model.parameters()):
    for replica in {replicas}:
        grad = list(replica.parameters())[i].grad
        if grad is None:
            continue
        {update}
return model
"""


def _reduce(update="param.grad = grad.clone() if param.grad is None else param.grad + grad", replicas="replicas"):
    return _REDUCE.format(update=update, replicas=replicas)


_GREEDY = """\
n = len(sec_per_row)
rows, finish = [0] * n, [{start}] + [0.0] * (n - 1)
for _ in range({count}):
    k = min(range(n), key=lambda d: {key})
    rows[k] += 1
    finish[k] += sec_per_row[k]
{tail}return rows
"""


def _greedy(start="overhead0", count="batch_size", key="finish[d] + sec_per_row[d]", tail=""):
    return _GREEDY.format(start=start, count=count, key=key, tail=tail)


_SCATTER = """\
batch = inputs[0].shape[{dim}]
sizes = {sizes}
used = {used}
def split(value):
    if isinstance(value, torch.Tensor):
        return gc.scatter(value, device_ids, chunk_sizes=sizes, dim={dim})
    return [value] * len(used)
args = [tuple(parts) for parts in zip(*map(split, inputs))]
{kwargs}
return args, kwargs_per_device, used
"""
_SPLIT_KWARGS = ("pieces = {key: split(value) for key, value in kwargs.items()}\n"
                 "kwargs_per_device = [{key: pieces[key][i] for key in pieces} for i in range(len(used))]")


def _scatter(dim="self.dim", sizes="gc.balanced_chunk_sizes(batch, self.gpu0_bsz, len(device_ids))",
             used="[d for d, s in zip(device_ids, sizes) if s > 0]", kwargs=_SPLIT_KWARGS):
    return _SCATTER.format(dim=dim, sizes=sizes, used=used, kwargs=kwargs)


_CHOOSE = """\
def peak(gpu0):
    sizes = gc.balanced_chunk_sizes(batch_size, gpu0, num_devices)
    return {peak}
return {choice}
"""


def _choose(peak="max([fixed0 + per_row * sizes[0]] + [fixed_other + per_row * s for s in sizes[1:]])",
            choice="min(range(batch_size + 1), key=lambda g: (peak(g), -g))"):
    return _CHOOSE.format(peak=peak, choice=choice)


VISIBLE = {
    "03.1": {
        "constant": "return model",
        "mean, as DDP": """\
for i, param in enumerate(model.parameters()):
    grads = [list(r.parameters())[i].grad for r in replicas]
    grads = [g.to(param.device) for g in grads if g is not None]
    if grads:
        g = torch.stack(grads).mean(0)
        param.grad = g if param.grad is None else param.grad + g
return model
""",
        "off-by-one: device 0's replica left out": _reduce(replicas="replicas[1:]"),
        "the last replica wins": _reduce(update="param.grad = grad.clone()"),
        "crashes on a replica without gradient": """\
for i, param in enumerate(model.parameters()):
    total = sum(list(r.parameters())[i].grad for r in replicas)   # None + tensor: TypeError
    param.grad = total if param.grad is None else param.grad + total
return model
""",
        "forgets to return the model": _reduce().replace("return model", "return None"),
        "overwrites an earlier step's gradient": """\
for i, param in enumerate(model.parameters()):
    grads = [list(r.parameters())[i].grad for r in replicas]
    grads = [g.to(param.device) for g in grads if g is not None]
    if grads:
        param.grad = torch.stack(grads).sum(0)  # overwrites: an earlier step's gradient is lost
return model
""",
        "adds into a replica's gradient": _reduce(
            update="if param.grad is None:\n            param.grad = grad          # the replica's own tensor\n"
                   "        else:\n            param.grad += grad"),
    },
    "03.2": {
        "constant": "return [batch_size] + [0] * (len(sec_per_row) - 1)",
        "least busy now": _greedy(key="finish[d]"),
        "off-by-one: the last row to device 0": _greedy(count="batch_size - 1", tail="rows[0] += 1 if batch_size else 0\n"),
        "ignores device 0's overhead": _greedy(start="0.0"),
        "rows in proportion to speed": """\
n = len(sec_per_row)
speed = [1 / p for p in sec_per_row]
rows = [int(batch_size * s / sum(speed)) for s in speed]
rows[0] += batch_size - sum(rows)
return rows
""",
        "gpu0_bsz + an even rest only": """\
n = len(sec_per_row)
if batch_size == 0:
    return [0] * n
def time_of(rows):
    return max([overhead0 + sec_per_row[0] * rows[0]] + [p * r for p, r in zip(sec_per_row[1:], rows[1:])])
return min((gc.balanced_chunk_sizes(batch_size, g, n) for g in range(batch_size + 1)), key=time_of)
""",
    },
    "03.3": {
        "DataParallel's even split": "return super().scatter(inputs, kwargs, device_ids)",
        "the parent's device list (the first devices)": _scatter(used="device_ids[:sum(1 for s in sizes if s > 0)]"),
        "keyword arguments dropped": _scatter(kwargs="kwargs_per_device = [{} for _ in used]"),
        "gpu0_bsz rows to the last device": _scatter(
            sizes="gc.balanced_chunk_sizes(batch, self.gpu0_bsz, len(device_ids))[::-1]"),
        "calls the forbidden helper": "return gc.BalancedDataParallel.scatter(self, inputs, kwargs, device_ids)",
        "tensor keyword arguments passed whole": _scatter(kwargs="kwargs_per_device = [dict(kwargs) for _ in used]"),
        "always along dim 0": _scatter(dim="0"),
    },
    "03.4": {
        "smallest on a tie": _choose(choice="min(range(batch_size + 1), key=peak)"),
        "device 0's memory only": _choose(peak="fixed0 + per_row * sizes[0]"),
        "ignores the fixed costs": _choose(peak="max(per_row * s for s in sizes)"),
        "solves the balance equation and rounds": """\
g = (fixed_other - fixed0 + per_row * batch_size / (num_devices - 1)) / (per_row * (1 + 1 / (num_devices - 1)))
return max(0, min(batch_size, round(g)))
""",
        "the average of the others, not their largest": _choose(
            peak="max(fixed0 + per_row * sizes[0], fixed_other + per_row * sum(sizes[1:]) / (num_devices - 1))"),
        "off-by-one: never batch_size": _choose(choice="min(range(batch_size), key=lambda g: (peak(g), -g))"),
    },
}

HIDDEN = {
    "03.1": {
        "only the first four replicas (the check's most)": _reduce(replicas="replicas[:4]"),
    },
    "03.2": {
        "lists for four devices (the check's most)": """\
rows, finish = [0] * 4, [overhead0, 0.0, 0.0, 0.0]
for _ in range(batch_size):
    k = min(range(len(sec_per_row)), key=lambda d: finish[d] + sec_per_row[d])
    rows[k] += 1
    finish[k] += sec_per_row[k]
return rows[:len(sec_per_row)]
""",
    },
    "03.3": {
        "the devices cut to the check's four": "device_ids = list(device_ids)[:4]\n" + _scatter(),
    },
    "03.4": {
        "gpu0_bsz searched up to 64 (the check's largest batch)": _choose(
            choice="min(range(min(batch_size, 64) + 1), key=lambda g: (peak(g), -g))"),
    },
}

(test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
 test_trivial_answers_fail) = chapter_tests("03", VISIBLE, HIDDEN)
