"""Chapter 00: plausible wrong answers its checks must reject (see ``_mutations.py``)."""

from _mutations import chapter_tests

VISIBLE = {
    "00.1": {
        "sum, not mean": "dist.all_reduce(tensor)\nreturn tensor",
        "a new tensor, input untouched": "out = tensor.clone()\ndist.all_reduce(out)\nreturn out / dist.get_world_size()",
        "divides by a hard-coded 2": "dist.all_reduce(tensor)\ntensor /= 2\nreturn tensor",
        "forgets to return": "dist.all_reduce(tensor)\ntensor /= dist.get_world_size()",
    },
    "00.2": {
        "no empty spec": """\
ids = [int(x) for x in spec.split(",")]          # int('') fails on an empty CUDA_VISIBLE_DEVICES
if not 0 <= logical < len(ids):
    raise IndexError(logical)
return ids[logical]
""",
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
        "the logical id itself": """\
ids = [int(x) for x in spec.split(",") if x.strip()]
if not 0 <= logical < len(ids):
    raise IndexError(logical)
return logical                                  # as if CUDA_VISIBLE_DEVICES renamed nothing
""",
        "calls the forbidden helper": """\
mapping = gc.visible_devices(spec)
if logical not in mapping:
    raise IndexError(logical)
return mapping[logical]
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
        "logical ids, not physical": """\
visible = list(range(machine_gpus)) if spec is None else []
for entry in ([] if spec is None else [e for e in spec.split(",") if e.strip()]):
    if not 0 <= int(entry) < machine_gpus:
        break
    visible.append(int(entry))
if not visible or not nccl_built:
    return "gloo", [None] * nprocs
if nprocs > len(visible):
    raise ValueError(nprocs)
return "nccl", list(range(nprocs))              # cuda:r, not the GPU behind it
""",
        # was hidden-only; the text names a negative id ("-1", the usual way to hide GPUs)
        "only ids past the machine end the list": """\
visible = list(range(machine_gpus)) if spec is None else []
for entry in ([] if spec is None else [e for e in spec.split(",") if e.strip()]):
    if int(entry) >= machine_gpus:              # a negative id slips through
        break
    visible.append(int(entry))
if not visible or not nccl_built:
    return "gloo", [None] * nprocs
if nprocs > len(visible):
    raise ValueError(nprocs)
return "nccl", visible[:nprocs]
""",
    },
    "00.4": {
        "chunk, not tensor_split": """\
share = values.chunk(world_size)[rank].sum()     # chunk makes fewer pieces than ranks for tiny inputs
total = share.clone()
dist.all_reduce(total)
return share, total
""",
        "every rank sums everything": """\
share = values.tensor_split(world_size)[rank].sum()
return share, values.sum()                       # right total, no collective: the work is not divided
""",
        "the share is all-reduced in place": """\
share = values.tensor_split(world_size)[rank].sum()
dist.all_reduce(share)
return share, share
""",
        "a mean, not the total": """\
share = values.tensor_split(world_size)[rank].sum()
total = share.clone()
dist.all_reduce(total)
return share, total / world_size
""",
        "interleaved, not contiguous": """\
share = values[rank::world_size].sum()
total = share.clone()
dist.all_reduce(total)
return share, total
""",
        "always float64": """\
share = values.tensor_split(world_size)[rank].sum().double()     # the exercise says: values' dtype
total = share.clone()
dist.all_reduce(total)
return share, total
""",
        # issue 38: right on 2 ranks (where ceil and tensor_split agree), wrong on 3 (7 = 3 + 3 + 1, not 3 + 2 + 2)
        "ceil chunking": """\
size = -(-len(values) // world_size)             # every rank but the last gets a full chunk
share = values[rank * size:(rank + 1) * size].sum()
total = share.clone()
dist.all_reduce(total)
return share, total
""",
        # found 2026-12-07: one collective of one element satisfied the count, and the total was summed here
        "a dummy collective, the total summed on each rank": """\
share = values.tensor_split(world_size)[rank].sum()
dist.all_reduce(torch.zeros(1, dtype=values.dtype))
return share, values.sum()
""",
        "the whole length all-reduced, not the share": """\
part = torch.zeros_like(values)
idx = torch.arange(len(values)).tensor_split(world_size)[rank]
part[idx] = values[idx]
dist.all_reduce(part)                            # every element travels, not one number per rank
return values[idx].sum(), part.sum()
""",
        "two collectives": """\
share = values.tensor_split(world_size)[rank].sum()
total = share.clone()
dist.all_reduce(total)
dist.broadcast(total, 0)                         # 'to be sure every rank has it'
return share, total
""",
    },
}

HIDDEN = {
    "00.1": {
        "hard-codes the check's shape": """\
parts = [torch.zeros(5) for _ in range(dist.get_world_size())]
dist.all_gather(parts, tensor)
tensor.copy_(torch.stack(parts).mean(0))
return tensor
""",
    },
    "00.2": {
        "at most 8 GPUs (a node's worth)": """\
ids = [int(x) for x in spec.split(",") if x.strip()][:8]       # a node has at most 8 GPUs, it thinks
if not 0 <= logical < len(ids):
    raise IndexError(logical)
return ids[logical]
""",
    },
    "00.4": {
        "rank 0 takes what is left over": """\
n, q = len(values), len(values) // world_size
start = 0 if rank == 0 else rank * q + n % world_size     # right while at most one element is left over
size = q + n % world_size if rank == 0 else q
share = values[start:start + size].sum()
total = share.clone()
dist.all_reduce(total)
return share, total
""",
    },
    "00.3": {
        "ids compared as strings": """\
visible = list(range(machine_gpus)) if spec is None else []
for entry in ([] if spec is None else [e.strip() for e in spec.split(",") if e.strip()]):
    if entry.startswith("-") or entry >= str(machine_gpus):     # right while every id has one digit
        break
    visible.append(int(entry))
if not visible or not nccl_built:
    return "gloo", [None] * nprocs
if nprocs > len(visible):
    raise ValueError(nprocs)
return "nccl", visible[:nprocs]
""",
    },
}

(test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
 test_trivial_answers_fail) = chapter_tests("00", VISIBLE, HIDDEN)
