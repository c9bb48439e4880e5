"""Chapter 02: plausible wrong answers its checks must reject (see ``_mutations.py``).

Ported from the old suites (tests/grading/test_hidden_checks.py, WRONG_ANSWERS): 02.1 "math.ceil of a
float", 02.2 "slicing wrong for dim < 0", 02.3 "always a tuple" — all VISIBLE now: the edges the
exercises name (batches beyond 2**53, negative dims, lists and None, fp16 autocast, several failing
modules) are in the visible checks (issue 38), and the hidden checks add sizes and randomness only. The old 02.4
(a DataParallel forward from gc.scatter/replicate/parallel_apply/gather) was printed by lesson 02 §3-4
and is replaced by a transfer (threads that carry the caller's grad mode and autocast state); its
old wrong answer "torch.cat instead of gather" lives on as 02.3's "a tuple output gathered by
torch.cat". 02.5 is new (predict, then measure).
"""

from _mutations import chapter_tests

_APPLY = """\
grad = torch.is_grad_enabled()
cast, cast_dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
outputs, errors = [None] * len(modules), [None] * len(modules)
def work(k):
    try:
        {context}
            outputs[k] = modules[k](inputs[k])
    except Exception as e:
        errors[k] = e
threads = [threading.Thread(target=work, args=(k,)) for k in range(len(modules))]
{run}
{reraise}
return outputs
"""
_START_ALL = "for t in threads:\n    t.start()\nfor t in threads:\n    t.join(timeout=60)"
_FIRST_ERROR = "for e in errors:\n    if e is not None:\n        raise e"
_CARRY = 'with torch.set_grad_enabled(grad), torch.autocast("cpu", enabled=cast, dtype=cast_dtype):'


def _apply(context=_CARRY, run=_START_ALL, reraise=_FIRST_ERROR):
    return _APPLY.format(context=context, run=run, reraise=reraise)


_RESIDENT = """\
step = -(-batch // num_devices)
chunks = [min(step, batch - start) for start in range(0, batch, step)]
held = [0] * num_devices
held[0] = {device0}
for k in range({first}, {last}):
    held[k] = {other}
return held
"""


def _resident(device0="(2 + optimizer_slots) * param_bytes + batch * row_bytes", first="1", last="len(chunks)",
              other="chunks[k] * row_bytes + param_bytes", chunks=None):
    text = _RESIDENT.format(device0=device0, first=first, last=last, other=other)
    if chunks:
        text = text.replace("chunks = [min(step, batch - start) for start in range(0, batch, step)]", chunks)
    return text


VISIBLE = {
    "02.1": {
        "the even split (gc.chunk_sizes' rule)": """\
base, extra = divmod(batch_size, num_devices)
return [base + 1 if i < extra else base for i in range(num_devices)]
""",
        "floor, not ceil": """\
step = max(1, batch_size // num_devices)
return [min(step, batch_size - start) for start in range(0, batch_size, step)]
""",
        "always one chunk per device": """\
step = -(-batch_size // num_devices)
return [max(0, min(step, batch_size - k * step)) for k in range(num_devices)]
""",
        "every chunk full": """\
step = -(-batch_size // num_devices)
return [step] * len(range(0, batch_size, step))
""",
        "calls the forbidden helper": "return gc.chunk_sizes_of(batch_size, num_devices)",
        "math.ceil of a float": """\
import math
step = math.ceil(batch_size / num_devices)
return [min(step, batch_size - start) for start in range(0, batch_size, step)]
""",
        "torch.chunk on an arange": "return [len(c) for c in torch.arange(batch_size).chunk(num_devices)]",
    },
    "02.2": {
        "keeps the empty pieces": """\
if sum(chunk_sizes) != x.shape[dim]:
    raise ValueError(chunk_sizes)
return list(torch.split(x, list(chunk_sizes), dim=dim))
""",
        "always along dim 0": """\
if sum(chunk_sizes) != x.shape[dim]:
    raise ValueError(chunk_sizes)
return [p for p in torch.split(x, list(chunk_sizes)) if p.shape[0] > 0]
""",
        "lets torch complain (RuntimeError)": "return [p for p in torch.split(x, list(chunk_sizes), dim=dim) if p.shape[dim] > 0]",
        "checks only a sum too large": """\
if sum(chunk_sizes) > x.shape[dim]:
    raise ValueError(chunk_sizes)
return [p for p in torch.split(x, list(chunk_sizes), dim=dim) if p.shape[dim] > 0]
""",
        "calls the forbidden helper": """\
if sum(chunk_sizes) != x.shape[dim]:
    raise ValueError(chunk_sizes)
return gc.scatter(x, [f"cpu:{i}" for i in range(len(chunk_sizes))], chunk_sizes=list(chunk_sizes), dim=dim)
""",
        "slicing wrong for dim < 0": """\
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
    },
    "02.3": {
        "always along dim 0": """\
first = outputs[0]
if isinstance(first, torch.Tensor):
    return torch.stack(list(outputs)) if first.dim() == 0 else torch.cat(list(outputs))
if isinstance(first, dict):
    return {key: gather_outputs([o[key] for o in outputs], dim) for key in first}
return type(first)(gather_outputs(list(parts), dim) for parts in zip(*outputs))
""",
        "stack, not cat": """\
first = outputs[0]
if isinstance(first, torch.Tensor):
    return torch.stack(list(outputs), dim=dim)
if isinstance(first, dict):
    return {key: gather_outputs([o[key] for o in outputs], dim) for key in first}
return type(first)(gather_outputs(list(parts), dim) for parts in zip(*outputs))
""",
        "0-dim losses averaged": """\
first = outputs[0]
if isinstance(first, torch.Tensor):
    return torch.stack(list(outputs)).mean() if first.dim() == 0 else torch.cat(list(outputs), dim=dim)
if isinstance(first, dict):
    return {key: gather_outputs([o[key] for o in outputs], dim) for key in first}
return type(first)(gather_outputs(list(parts), dim) for parts in zip(*outputs))
""",
        "0-dim not handled": """\
first = outputs[0]
if isinstance(first, torch.Tensor):
    return torch.cat(list(outputs), dim=dim)
if isinstance(first, dict):
    return {key: gather_outputs([o[key] for o in outputs], dim) for key in first}
return type(first)(gather_outputs(list(parts), dim) for parts in zip(*outputs))
""",
        "a tuple output gathered by torch.cat": """\
first = outputs[0]
if isinstance(first, torch.Tensor):
    return torch.stack(list(outputs)) if first.dim() == 0 else torch.cat(list(outputs), dim=dim)
if isinstance(first, dict):
    return {key: gather_outputs([o[key] for o in outputs], dim) for key in first}
return torch.cat([torch.cat(list(parts), dim=dim) for parts in zip(*outputs)], dim=dim)
""",
        "calls the forbidden helper": "return gc.gather(outputs, 'cpu:0', dim=dim)",
        "always a tuple": """\
first = outputs[0]
if isinstance(first, torch.Tensor):
    return torch.stack(list(outputs)) if first.dim() == 0 else torch.cat(list(outputs), dim=dim)
if isinstance(first, dict):
    return {key: gather_outputs([o[key] for o in outputs], dim) for key in first}
return tuple(gather_outputs(list(parts), dim) for parts in zip(*outputs))
""",
    },
    "02.4": {
        "serial, in the caller": "return [m(x) for m, x in zip(modules, inputs)]",
        "no overlap: start, join, start, join": _apply(run="for t in threads:\n    t.start()\n    t.join(timeout=60)"),
        "grad mode not carried": _apply(context='with torch.autocast("cpu", enabled=cast, dtype=cast_dtype):'),
        "autocast not carried": _apply(context="with torch.set_grad_enabled(grad):"),
        "exceptions swallowed": _apply(reraise=""),
        "calls the forbidden helper": "return gc.parallel_apply(modules, [(x,) for x in inputs], [f'cpu:{k}' for k in range(len(modules))])",
        "autocast flag only, not its dtype": _apply(
            context='with torch.set_grad_enabled(grad), torch.autocast("cpu", enabled=cast):'),
        "re-raises the last failure": _apply(reraise="for e in reversed(errors):\n    if e is not None:\n        raise e"),
        # values that are wrong but close: bf16 rounding is 4e-3, far beyond float32's tolerance
        "fp32 outputs rounded through bf16": _apply().replace(
            "return outputs", "return [o.bfloat16().float() if o.dtype == torch.float32 else o for o in outputs]"),
        "the outputs in reverse order": _apply().replace("return outputs", "return outputs[::-1]"),
    },
    "02.5": {
        "forgets the optimizer state": _resident(device0="2 * param_bytes + batch * row_bytes"),
        "forgets the gradients": _resident(device0="(1 + optimizer_slots) * param_bytes + batch * row_bytes"),
        "a replica on device 0 too": _resident(device0="(3 + optimizer_slots) * param_bytes + batch * row_bytes"),
        "device 0's chunk counted again": _resident(
            device0="(2 + optimizer_slots) * param_bytes + (batch + chunks[0]) * row_bytes"),
        "replicas on idle devices": _resident(last="num_devices",
                                              other="(chunks[k] if k < len(chunks) else 0) * row_bytes + param_bytes"),
        "the even split": _resident(
            chunks="chunks = [c for c in [batch // num_devices + (k < batch % num_devices) for k in range(num_devices)] if c]"),
        "gradients on every device": _resident(other="chunks[k] * row_bytes + 2 * param_bytes"),
        "math.ceil of a float": _resident(chunks="import math\nstep = math.ceil(batch / num_devices)\n"
                                                 "chunks = [min(step, batch - start) for start in range(0, batch, step)]"),
    },
}

HIDDEN = {
    "02.1": {
        "int64 tensors (overflow past 2**63)": """\
b = torch.tensor(batch_size)                    # int64: exact integer arithmetic
step = int((b + num_devices - 1) // num_devices)
return [min(step, batch_size - start) for start in range(0, batch_size, step)]
""",
    },
    "02.2": {
        "negative dims counted from 3 dimensions": """\
if dim < 0:
    dim += 3                                    # the check's tensors are 3-D
if sum(chunk_sizes) != x.shape[dim]:
    raise ValueError(f"chunk sizes {chunk_sizes} do not add up to {x.shape[dim]}")
return [p for p in torch.split(x, list(chunk_sizes), dim=dim) if p.shape[dim] > 0]
""",
    },
    "02.3": {
        "negative dims counted as if every output were 2-D": """\
if dim < 0:
    dim += 2
first = outputs[0]
if first is None:
    return None
if isinstance(first, torch.Tensor):
    return torch.stack(list(outputs)) if first.dim() == 0 else torch.cat(list(outputs), dim=dim)
if isinstance(first, dict):
    return {key: gather_outputs([o[key] for o in outputs], dim) for key in first}
return type(first)(gather_outputs(list(parts), dim) for parts in zip(*outputs))
""",
    },
    "02.4": {
        "outputs kept in 4 slots (the check's largest)": _apply().replace(
            "outputs, errors = [None] * len(modules), [None] * len(modules)",
            "outputs, errors = [None] * 4, [None] * len(modules)").replace(
            "return outputs", "return outputs[:len(modules)]"),
    },
    "02.5": {
        "int64 tensors (overflow past 2**63)": _resident(chunks="b = torch.tensor(batch)                          # int64: exact integers\n"
                                                                "step = int((b + num_devices - 1) // num_devices)\n"
                                                                "chunks = [min(step, batch - start) for start in range(0, batch, step)]"),
    },
}

(test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
 test_trivial_answers_fail) = chapter_tests("02", VISIBLE, HIDDEN)
