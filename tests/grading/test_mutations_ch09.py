"""Chapter 09: plausible wrong answers its checks must reject (see ``_mutations.py``).

Ported from ``test_hidden_checks.WRONG_ANSWERS``: 09.2 (ceil split: now caught by the visible
check, which has 3 ranks and features that do not divide), 09.3 (no max: visible since issue 38, large
logits), 09.4 (tp and dp swapped: now visible, the meshes are not square), 09.5 (``tp = 1`` not
special: visible since issue 38, which moved the edge ideas an exercise names into the visible
cases). Exercise 09.1 changed — the lesson prints the tensor-parallel f and g,
so the exercise asks for sequence parallelism's all-gather / reduce-scatter pair — and its old wrong
answer ("g's backward sums too") became "the reduce-scatter's backward is the identity, as g's"
(visible).
"""

from _mutations import chapter_tests

_RS = "return x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()"

_COLUMN_INIT = """\
sizes = [len(c) for c in torch.tensor_split(torch.arange(linear.out_features), world_size)]
start = sum(sizes[:rank])
rows = slice(start, start + sizes[rank])
{body}
"""

_VOCAB = """\
m = logits_shard.detach().max(dim=-1).values
dist.all_reduce(m, op=dist.ReduceOp.MAX)
shifted = logits_shard - m.unsqueeze(-1)
sum_exp = gc.reduce_from_tensor_parallel(shifted.exp().sum(dim=-1))
local = target - start
{mine}
picked = shifted.gather(-1, local.clamp(0, logits_shard.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
{picked}
return (sum_exp.log() - picked).{reduce}()
"""
_MINE = "mine = (local >= 0) & (local < logits_shard.shape[-1])"
_PICKED = "picked = gc.reduce_from_tensor_parallel(torch.where(mine, picked, torch.zeros_like(picked)))"

_COORDS = """\
{check}
dp_rank, tp_rank = divmod(rank, tp)
return {result}
"""
_CHECK = """\
if not 0 <= rank < tp * dp:
    raise ValueError(rank)"""

VISIBLE = {
    "09.1": {
        "the all-gather's backward keeps its slice without summing": [None, """\
return grad.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()
""", None, None],
        "the reduce-scatter's forward keeps its slice without summing": [None, None, _RS, None],
        "the reduce-scatter's backward is the identity, as g's": [None, None, None, "return grad"],
        # issue 38: right values, the wrong communication (p times the bytes of an all-gather)
        "the all-gather as an all-reduce of a zero-padded sequence": ["""\
p, r, s = dist.get_world_size(), dist.get_rank(), x.shape[1]
full = torch.zeros(x.shape[0], s * p, x.shape[2], dtype=x.dtype)
full[:, r * s:(r + 1) * s] = x
dist.all_reduce(full)
return full
""", None, None, None],
        "gathers along dim 0": ["""\
x = x.contiguous()
parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
dist.all_gather(parts, x)
return torch.cat(parts, dim=0)
""", """\
total = grad.contiguous().clone()
dist.all_reduce(total)
return total.chunk(dist.get_world_size(), dim=0)[dist.get_rank()].contiguous()
""", None, None],
        "all-reduces autograd's input in place": [None, None, """\
dist.all_reduce(x)
return x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()
""", None],
    },
    "09.2": {
        "ceil split: the last rank takes what is left (ported)": ["""\
per_rank = -(-linear.out_features // world_size)      # ceil: the last rank takes what is left
rows = slice(rank * per_rank, (rank + 1) * per_rank)
self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
self.bias = nn.Parameter(linear.bias.detach()[rows].clone())
""", None],
        "no f in front": [None, "return F.linear(x, self.weight, self.bias)"],
        "assumes a bias": [_COLUMN_INIT.format(body="""\
self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
self.bias = nn.Parameter(linear.bias.detach()[rows].clone())"""), None],
        "torch.chunk": ["""\
rows = torch.chunk(torch.arange(linear.out_features), world_size)[rank]
self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows].clone())
""", None],
        "plain tensors, not nn.Parameter": [_COLUMN_INIT.format(body="""\
self.weight = linear.weight.detach()[rows].clone()
self.bias = None if linear.bias is None else linear.bias.detach()[rows].clone()"""), None],
        "the whole bias on every rank": [_COLUMN_INIT.format(body="""\
self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())"""), None],
    },
    "09.3": {
        "the max of this rank's shard only": """\
m = logits_shard.detach().max(dim=-1).values
shifted = logits_shard - m.unsqueeze(-1)
sum_exp = gc.reduce_from_tensor_parallel(shifted.exp().sum(dim=-1))
local = target - start
mine = (local >= 0) & (local < logits_shard.shape[-1])
picked = shifted.gather(-1, local.clamp(0, logits_shard.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
picked = gc.reduce_from_tensor_parallel(torch.where(mine, picked, torch.zeros_like(picked)))
return (sum_exp.log() - picked).mean()
""",
        "the sum, not the mean": _VOCAB.format(mine=_MINE, picked=_PICKED, reduce="sum"),
        "every rank adds a logit (no owner mask)": _VOCAB.format(
            mine=_MINE, picked="picked = gc.reduce_from_tensor_parallel(picked)", reduce="mean"),
        "forgets that ids below start are not mine": _VOCAB.format(
            mine="mine = local < logits_shard.shape[-1]", picked=_PICKED, reduce="mean"),
        "gathers the logits": """\
parts = [torch.empty_like(logits_shard) for _ in range(dist.get_world_size())]
dist.all_gather(parts, logits_shard.detach().contiguous())
parts[dist.get_rank()] = logits_shard
return F.cross_entropy(torch.cat(parts, dim=-1), target)
""",
        "no max: exp overflows (ported)": """\
sum_exp = gc.reduce_from_tensor_parallel(logits_shard.exp().sum(dim=-1))   # no max: exp overflows
local = target - start
mine = (local >= 0) & (local < logits_shard.shape[-1])
picked = logits_shard.gather(-1, local.clamp(0, logits_shard.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
picked = gc.reduce_from_tensor_parallel(torch.where(mine, picked, torch.zeros_like(picked)))
return (sum_exp.log() - picked).mean()
""",
    },
    "09.4": {
        "tp and dp swapped (ported)": [_CHECK + """
dp_rank, tp_rank = divmod(rank, dp)             # tp and dp swapped
return tp_rank, dp_rank
""", """\
dp_rank = rank // dp
return [dp_rank * dp + t for t in range(dp)]
""", """\
tp_rank = rank % dp
return [d * dp + tp_rank for d in range(tp)]
"""],
        "column-major layout": [_CHECK + """
tp_rank, dp_rank = divmod(rank, dp)             # as if rank = tp_rank * dp + dp_rank
return tp_rank, dp_rank
""", """\
tp_rank = rank // dp
return [tp_rank * dp + d for d in range(dp)]
""", """\
dp_rank = rank % dp
return [t * dp + dp_rank for t in range(tp)]
"""],
        "the dp group is the consecutive one": [None, None, """\
dp_rank = rank // tp
return [dp_rank * tp + t for t in range(tp)]
"""],
        "(dp_rank, tp_rank)": [_COORDS.format(check=_CHECK, result="dp_rank, tp_rank"), None, None],
        "the first rank past the mesh is accepted": [_COORDS.format(check="""\
if rank < 0 or rank > tp * dp:
    raise ValueError(rank)""", result="tp_rank, dp_rank"), None, None],
        "no ValueError": [_COORDS.format(check="", result="tp_rank, dp_rank"), None, None],
        "negative ranks slip through": [_COORDS.format(check="""\
if rank >= tp * dp:
    raise ValueError(rank)""", result="tp_rank, dp_rank"), None, None],
    },
    "09.5": {
        "forward only (2 all-reduces)": "return 0 if tp == 1 else 2 * layers * batch * seq * hidden * dtype_bytes",
        "divided by tp": "return 0 if tp == 1 else 4 * layers * batch * seq * hidden * dtype_bytes // tp",
        "elements, not bytes": "return 0 if tp == 1 else 4 * layers * batch * seq * hidden",
        "the ring's bytes on the wire": (
            "return 0 if tp == 1 else 4 * layers * batch * seq * hidden * dtype_bytes * 2 * (tp - 1) // tp"),
        "calls the forbidden helper": "return gc.tp_comm_bytes(batch, seq, hidden, layers, tp, dtype_bytes)",
        "tp = 1 is not special (ported)": "return 4 * layers * batch * seq * hidden * dtype_bytes   # even when tp = 1",
    },
    "09.6": {
        "the bias on every rank, before the sum": """\
mine = torch.arange(w.shape[1]).tensor_split(world_size)[rank]
partial = x[:, mine] @ w[:, mine].T
y = partial + b
dist.all_reduce(y)                              # every rank's bias is summed too
return partial, y
""",
        "output features split, not input features": """\
mine = torch.arange(w.shape[0]).tensor_split(world_size)[rank]
partial = x @ w[mine].T                         # a column-parallel piece
y = partial.clone()
dist.all_reduce(y)
return partial, y + b
""",
        "no collective": """\
mine = torch.arange(w.shape[1]).tensor_split(world_size)[rank]
partial = x[:, mine] @ w[:, mine].T
return partial, partial + b
""",
        "interleaved features": """\
mine = torch.arange(rank, w.shape[1], world_size)
partial = x[:, mine] @ w[:, mine].T
y = partial.clone()
dist.all_reduce(y)
return partial, y + b
""",
        "a mean over the ranks": """\
mine = torch.arange(w.shape[1]).tensor_split(world_size)[rank]
partial = x[:, mine] @ w[:, mine].T
y = partial.clone()
dist.all_reduce(y)
return partial, y / world_size + b
""",
        "chunk, not tensor_split": """\
mine = torch.arange(w.shape[1]).chunk(world_size)[rank]    # one feature: one chunk, rank 1 has none to index
partial = x[:, mine] @ w[:, mine].T
y = partial.clone()
dist.all_reduce(y)
return partial, y + b
""",
        # the notebook starts 2 live ranks: passed the visible check while every case ran on them
        "split in two, the notebook's number of ranks": """\
mine = torch.arange(w.shape[1]).tensor_split(2)[rank]
partial = x[:, mine] @ w[:, mine].T
y = partial.clone()
dist.all_reduce(y)
return partial, y + b
""",
        # issue 38: right values, no communication (every rank is given the whole w)
        "y computed on every rank, no collective": """\
mine = torch.arange(w.shape[1]).tensor_split(world_size)[rank]
partial = x[:, mine] @ w[:, mine].T
return partial, x @ w.T + b
""",
        "all-gathers the partials, then sums them": """\
mine = torch.arange(w.shape[1]).tensor_split(world_size)[rank]
partial = x[:, mine] @ w[:, mine].T
parts = [torch.empty_like(partial) for _ in range(world_size)]
dist.all_gather(parts, partial)                 # world_size times the bytes of one all-reduce's input
return partial, torch.stack(parts).sum(0) + b
""",
    },
}

HIDDEN = {
    "09.1": {
        "receive buffers of the default dtype": ["""\
x = x.contiguous()
parts = [torch.empty(x.shape) for _ in range(dist.get_world_size())]
dist.all_gather(parts, x)
return torch.cat(parts, dim=1)
""", None, None, None],
    },
    "09.2": {
        "rows from its first to its last id": ["""\
ids = torch.tensor_split(torch.arange(linear.out_features), world_size)[rank]
rows = slice(ids[0], ids[-1] + 1)                # an empty shard has no first id
self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows].clone())
""", None],
    },
    "09.3": {
        "the target's logit in a zeros buffer of the default dtype": """\
m = logits_shard.detach().max(dim=-1).values
dist.all_reduce(m, op=dist.ReduceOp.MAX)
shifted = logits_shard - m.unsqueeze(-1)
sum_exp = gc.reduce_from_tensor_parallel(shifted.exp().sum(dim=-1))
local = target - start
mine = (local >= 0) & (local < logits_shard.shape[-1])
picked = torch.zeros(target.shape[0])            # float32, whatever the logits are
picked[mine] = shifted[mine, local[mine]]
picked = gc.reduce_from_tensor_parallel(picked)
return (sum_exp.log() - picked).mean()
""",
    },
    "09.4": {
        "the dp group searched among the first 64 ranks": [None, None, """\
return [r for r in range(min(tp * dp, 64)) if r % tp == rank % tp]   # a table sized for the visible meshes (<= 36 ranks)
"""],
    },
    "09.5": {
        "fp32 or bf16 elements only": (
            "return 0 if tp == 1 else 4 * layers * batch * seq * hidden * (2 if dtype_bytes == 2 else 4)"),
    },
    "09.6": {
        "a zeros buffer of the default dtype": """\
mine = torch.arange(w.shape[1]).tensor_split(world_size)[rank]
partial = x[:, mine] @ w[:, mine].T
y = torch.zeros(x.shape[0], w.shape[0])         # float32, whatever x is
y += partial
if rank == 0:
    y += b                                      # the bias once: on rank 0, before the sum
dist.all_reduce(y)
return partial, y
""",
    },
}

(test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
 test_trivial_answers_fail) = chapter_tests("09", VISIBLE, HIDDEN)
