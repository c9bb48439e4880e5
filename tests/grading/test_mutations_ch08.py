"""Chapter 08: plausible wrong answers its checks must reject (see ``_mutations.py``).

Ported from ``tests/sharding/test_ch08_exercise_checks.py`` (WRONG, each used to pass the visible
check): 08.1 "forgets k, floats" (now caught by the visible check: sizes that do not divide, k of 4
and 8), 08.2 "chunk() + pad" (now visible: tiny buffers), 08.3 "only right for 2 ranks" (now
visible: 3 ranks), 08.4 "sums instead of averaging" (now visible: SGD with momentum), 08.5 "greedy:
biggest saving first" (now visible: unequal costs). Exercise 08.1's stub is now ``bytes_per_device``
(it was ``model_state_bytes``, which shadowed ``gc.model_state_bytes``).

Issue 38: every edge idea the exercises name is in the visible checks: no parameters and sizes beyond
float precision (08.1), ranks entirely in the padding, an empty buffer, fp16/bf16 (08.2), fp64 (08.3),
3 ranks (08.4), fractional costs and budgets exactly at a plan's bytes (08.5); their wrong answers moved
from HIDDEN to VISIBLE. The hidden checks add only sizes and randomness (any k, up to 300 ranks, larger
buffers, 4 ranks, AdamW, more blocks), and each keeps a wrong answer only they catch.
"""

from _mutations import chapter_tests

_SHARD = """\
s = -(-flat.numel() // world_size)
{body}
"""

_RS_RING = """\
rank, p = dist.get_rank(), dist.get_world_size()
chunks = [c.clone() for c in tensor.chunk(p)]
right, left = (rank + 1) % p, (rank - 1) % p
for step in range(p - 1):                        # the ring of chapter 04
    send_idx, recv_idx = (rank - step) % p, (rank - step - 1) % p
    incoming = torch.empty_like(chunks[recv_idx])
    works = [dist.irecv(incoming, left), dist.isend(chunks[send_idx].contiguous(), right)]
    for w in works:
        w.wait()
    chunks[recv_idx] += incoming
return chunks[{index}]
"""

_ZERO1 = """\
world_size = dist.get_world_size()
{body}
"""

VISIBLE = {
    "08.1": {
        "math.ceil of a float division": """\
import math
n = world_size
total = 2 * num_params * (1 if stage >= 3 else n) + 2 * num_params * (1 if stage >= 2 else n) \\
    + k * num_params * (1 if stage >= 1 else n)
return math.ceil(total / n)
""",
        "forgets k, floats (ported)": """\
n = world_size
return round(2 * num_params / (n if stage >= 3 else 1) + 2 * num_params / (n if stage >= 2 else 1)
             + 12 * num_params / (n if stage >= 1 else 1))
""",
        "rounds down": """\
n = world_size
return (2 * num_params * (1 if stage >= 3 else n) + 2 * num_params * (1 if stage >= 2 else n)
        + k * num_params * (1 if stage >= 1 else n)) // n
""",
        "a float": """\
n = world_size
return (2 * num_params / (n if stage >= 3 else 1) + 2 * num_params / (n if stage >= 2 else 1)
        + k * num_params / (n if stage >= 1 else 1))
""",
        "each part rounded up separately": """\
n = world_size
def part(nbytes, sharded):
    return -(-nbytes // n) if sharded else nbytes
return part(2 * num_params, stage >= 3) + part(2 * num_params, stage >= 2) + part(k * num_params, stage >= 1)
""",
        "stage s shards s+1 parts (off by one)": """\
n = world_size
params = 2 * num_params * (1 if stage >= 2 else n)
grads = 2 * num_params * (1 if stage >= 1 else n)
state = k * num_params * (1 if stage >= 0 else n)
return -(-(params + grads + state) // n)
""",
        "calls the forbidden helper": "return gc.zero_memory(num_params, world_size, stage, k=k)",
    },
    "08.2": {
        "narrow by the remaining length": _SHARD.format(body="""\
length = min(s, flat.numel() - rank * s)
piece = flat.narrow(0, rank * s, length)
return torch.cat([piece, torch.zeros(s - length, dtype=flat.dtype)])"""),
        "chunk() + pad (ported)": """\
piece = flat.chunk(world_size)[rank]
s = -(-flat.numel() // world_size)
return torch.cat([piece, torch.zeros(s - piece.numel(), dtype=flat.dtype)])
""",
        "a view when no padding is needed": _SHARD.format(body="""\
piece = flat[rank * s:(rank + 1) * s]
if piece.numel() == s:
    return piece
return torch.cat([piece, torch.zeros(s - piece.numel(), dtype=flat.dtype)])"""),
        "zeros of the default dtype": _SHARD.format(body="""\
out = torch.zeros(s)
piece = flat[rank * s:(rank + 1) * s]
out[:piece.numel()] = piece
return out"""),
        "S rounded down": """\
s = flat.numel() // world_size
out = torch.zeros(s, dtype=flat.dtype)
piece = flat[rank * s:(rank + 1) * s]
out[:piece.numel()] = piece
return out
""",
        "tensor_split shards, padded": _SHARD.format(body="""\
piece = torch.tensor_split(flat, world_size)[rank]
return torch.cat([piece, torch.zeros(s - piece.numel(), dtype=flat.dtype)])"""),
        "padding in front": _SHARD.format(body="""\
piece = flat[rank * s:(rank + 1) * s]
return torch.cat([torch.zeros(s - piece.numel(), dtype=flat.dtype), piece])"""),
    },
    "08.3": {
        "fp32 result, whatever the input's dtype": """\
rank, p = dist.get_rank(), dist.get_world_size()
chunks = [c.contiguous() for c in tensor.chunk(p)]
incoming = {src: torch.empty_like(chunks[rank]) for src in range(p) if src != rank}
works = [dist.irecv(buf, src) for src, buf in incoming.items()]
works += [dist.isend(chunks[dst], dst) for dst in range(p) if dst != rank]
for w in works:
    w.wait()
result = torch.zeros(tensor.numel() // p)       # the default dtype
result += chunks[rank]
for src in sorted(incoming):
    result += incoming[src]
return result
""",
        "only right for 2 ranks (ported)": """\
rank = dist.get_rank()
other = 1 - rank
chunks = [c.contiguous() for c in tensor.chunk(2)]
incoming = torch.empty_like(chunks[rank])
works = [dist.irecv(incoming, other), dist.isend(chunks[other], other)]
for w in works:
    w.wait()
return chunks[rank] + incoming
""",
        "the ring, returning chunk rank (not the fully summed one)": _RS_RING.format(index="rank"),
        "the mean, not the sum": """\
rank, p = dist.get_rank(), dist.get_world_size()
chunks = [c.contiguous() for c in tensor.chunk(p)]
result = chunks[rank].clone()
incoming = {src: torch.empty_like(result) for src in range(p) if src != rank}
works = [dist.irecv(buf, src) for src, buf in incoming.items()]
works += [dist.isend(chunks[dst], dst) for dst in range(p) if dst != rank]
for w in works:
    w.wait()
for src in sorted(incoming):
    result += incoming[src]
return result / p
""",
        "calls torch's collective": """\
p = dist.get_world_size()
out = torch.empty(tensor.numel() // p, dtype=tensor.dtype)
dist.reduce_scatter_single(out, tensor.contiguous())
return out
""",
        "calls the forbidden helper": "return gc.reduce_scatter(tensor)",
    },
    "08.4": {
        "divides by 2": """\
grad = torch.empty_like(shard)
dist.reduce_scatter_single(grad, flat_grad.contiguous())
shard.grad = grad / 2
optimizer.step()
dist.all_gather_single(flat, shard.detach().contiguous())
""",
        "sums instead of averaging (ported)": """\
grad = torch.empty_like(shard)
dist.reduce_scatter_single(grad, flat_grad.contiguous())
shard.grad = grad
optimizer.step()
dist.all_gather_single(flat, shard.detach().contiguous())
""",
        "no all-gather": _ZERO1.format(body="""\
grad = torch.empty_like(shard)
dist.reduce_scatter_single(grad, flat_grad.contiguous())
shard.grad = grad / world_size
optimizer.step()"""),
        "only the local gradient": _ZERO1.format(body="""\
rank, s = dist.get_rank(), shard.numel()
shard.grad = flat_grad[rank * s:(rank + 1) * s].clone()
optimizer.step()
dist.all_gather_single(flat, shard.detach().contiguous())"""),
        "all-gathers before the step": _ZERO1.format(body="""\
grad = torch.empty_like(shard)
dist.reduce_scatter_single(grad, flat_grad.contiguous())
shard.grad = grad / world_size
dist.all_gather_single(flat, shard.detach().contiguous())
optimizer.step()"""),
        # right parameters, twice the gradient traffic: passed the visible and the hidden check while they
        # compared parameters only
        "all-reduces the whole gradient, then slices": _ZERO1.format(body="""\
rank = dist.get_rank()
dist.all_reduce(flat_grad)                      # every rank gets the whole summed gradient
s = shard.numel()
shard.grad = flat_grad[rank * s:(rank + 1) * s] / world_size
optimizer.step()
parts = [torch.empty_like(shard) for _ in range(world_size)]
dist.all_gather(parts, shard.detach())
flat.copy_(torch.cat(parts))"""),
        "all-gathers through an all-reduce of a zero-padded buffer": _ZERO1.format(body="""\
grad = torch.empty_like(shard)
dist.reduce_scatter_single(grad, flat_grad.contiguous())
shard.grad = grad / world_size
optimizer.step()
rank, s = dist.get_rank(), shard.numel()
full = torch.zeros_like(flat)
full[rank * s:(rank + 1) * s] = shard.detach()
dist.all_reduce(full)                           # the same parameters, the whole buffer's traffic
flat.copy_(full)"""),
    },
    "08.5": {
        "knapsack table indexed by an integer cost": """\
n = len(full_bytes)
need = sum(full_bytes) - budget                 # bytes to save
table = [None] * (sum(costs) + 1)               # table[c]: (most bytes saved, blocks) at cost exactly c
table[0] = (0, [])
for i in range(n):
    for c in range(sum(costs), costs[i] - 1, -1):
        prev = table[c - costs[i]]
        if prev is not None and (table[c] is None or prev[0] + full_bytes[i] - kept_bytes[i] > table[c][0]):
            table[c] = (prev[0] + full_bytes[i] - kept_bytes[i], prev[1] + [i])
for entry in table:
    if entry is not None and entry[0] >= need:
        return sorted(entry[1])
return None
""",
        "greedy: biggest saving first (ported)": """\
n = len(full_bytes)
held, chosen = sum(full_bytes), []
for i in sorted(range(n), key=lambda i: kept_bytes[i] - full_bytes[i]):
    if held <= budget:
        break
    held -= full_bytes[i] - kept_bytes[i]
    chosen.append(i)
return sorted(chosen) if held <= budget else None
""",
        "fewest blocks, costs ignored": """\
n = len(full_bytes)
for r in range(n + 1):
    for subset in itertools.combinations(range(n), r):
        if sum(kept_bytes[i] if i in subset else full_bytes[i] for i in range(n)) <= budget:
            return list(subset)
return None
""",
        "[] when nothing fits": """\
n = len(full_bytes)
best, best_cost = [], None
for r in range(n + 1):
    for subset in itertools.combinations(range(n), r):
        held = sum(kept_bytes[i] if i in subset else full_bytes[i] for i in range(n))
        cost = sum(costs[i] for i in subset)
        if held <= budget and (best_cost is None or cost < best_cost):
            best, best_cost = list(subset), cost
return best
""",
        "strictly under the budget": """\
n = len(full_bytes)
best, best_cost = None, None
for r in range(n + 1):
    for subset in itertools.combinations(range(n), r):
        held = sum(kept_bytes[i] if i in subset else full_bytes[i] for i in range(n))
        cost = sum(costs[i] for i in subset)
        if held < budget and (best_cost is None or cost < best_cost):
            best, best_cost = list(subset), cost
return best
""",
        "the blocks to keep, not the ones to checkpoint": """\
n = len(full_bytes)
best, best_cost = None, None
for r in range(n + 1):
    for subset in itertools.combinations(range(n), r):
        held = sum(kept_bytes[i] if i in subset else full_bytes[i] for i in range(n))
        cost = sum(costs[i] for i in subset)
        if held <= budget and (best_cost is None or cost < best_cost):
            best, best_cost = [i for i in range(n) if i not in subset], cost
return best
""",
    },
}

HIDDEN = {
    "08.1": {
        "the optimizer state in whole fp32 copies (4 * (k // 4))": """\
n = world_size
state = 4 * (k // 4)                            # master weights, momentum, variance: 4 bytes each
total = 2 * num_params * (1 if stage >= 3 else n) + 2 * num_params * (1 if stage >= 2 else n) \\
    + state * num_params * (1 if stage >= 1 else n)
return -(-total // n)
""",
    },
    "08.2": {
        "pads in a fixed scratch buffer of 256 elements": _SHARD.format(body="""\
scratch = torch.zeros(256, dtype=flat.dtype)    # big enough for the examples
piece = flat[rank * s:(rank + 1) * s]
scratch[:piece.numel()] = piece
return scratch[:s].clone()"""),
    },
    "08.3": {
        "exchanges chunks with its two ring neighbours only (all the others, on 2 or 3 ranks)": """\
rank, p = dist.get_rank(), dist.get_world_size()
chunks = [c.contiguous() for c in tensor.chunk(p)]
peers = sorted({(rank - 1) % p, (rank + 1) % p} - {rank})
incoming = {src: torch.empty_like(chunks[rank]) for src in peers}
works = [dist.irecv(buf, src) for src, buf in incoming.items()]
works += [dist.isend(chunks[dst], dst) for dst in peers]
for w in works:
    w.wait()
result = chunks[rank].clone()
for src in peers:
    result += incoming[src]
return result
""",
    },
    "08.4": {
        "SGD + momentum by hand (the visible optimizer), no optimizer.step()": _ZERO1.format(body="""\
grad = torch.empty_like(shard)
dist.reduce_scatter_single(grad, flat_grad.contiguous())
grad /= world_size
state = optimizer.state[shard]
buf = state.get("momentum_buffer")
buf = grad.clone() if buf is None else buf.mul_(0.9).add_(grad)
state["momentum_buffer"] = buf
with torch.no_grad():
    shard -= 0.1 * buf
dist.all_gather_single(flat, shard.detach().contiguous())"""),
    },
    "08.5": {
        "every subset of at most 7 blocks (2 ** 7 masks hard-coded)": """\
n = len(full_bytes)
best, best_cost = None, None
for mask in range(2 ** 7):                      # every subset of the blocks
    subset = [i for i in range(n) if mask >> i & 1]
    held = sum(kept_bytes[i] if i in subset else full_bytes[i] for i in range(n))
    cost = sum(costs[i] for i in subset)
    if held <= budget and (best_cost is None or cost < best_cost):
        best, best_cost = subset, cost
return best
""",
    },
}

(test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
 test_trivial_answers_fail) = chapter_tests("08", VISIBLE, HIDDEN)
