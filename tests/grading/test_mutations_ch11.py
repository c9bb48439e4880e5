"""Chapter 11: plausible wrong answers its checks must reject (see ``_mutations.py``).

Ported from ``tests/grading/test_hidden_checks.py`` (``WRONG_ANSWERS``), each kept as the same
mistake in the exercise's new form: 11.1 "no max subtracted" (now VISIBLE: the running maximum is
part of the state), 11.2 "the ring turned the wrong way" (now VISIBLE: 3-5 ranks), 11.3 "no check"
(now VISIBLE: shards of different or odd lengths), 11.4 "floor, not ceil" (now VISIBLE: capacities that
are not whole numbers), 11.5 "assumes the experts divide evenly" (now VISIBLE), 11.6 "the other
rank" (now VISIBLE: 2-6 ranks).

Issue 38: every edge idea the exercises name is in the visible checks: scores in the hundreds, rows
with no visible key, ring order, fp64 (11.1), causal=False and one rank (11.2), one rank, other dtypes
and lengths that raise (11.3), no limit, k = 1, 3 and E, whole-number capacities (11.4), ranks that own
no expert, one rank, int32 (11.5), bf16 (11.6); their wrong answers moved from HIDDEN to VISIBLE. The
hidden checks add only sizes and randomness (other score scales, 6-16 ranks, more experts, published
sizes), each with a wrong answer only they catch.

``test_solutions_agree_with_the_package`` checks the other direction: the course's answers, which
the judge uses as the reference, agree with the package functions the exercises forbid.
"""

import math

import torch
import torch.nn.functional as F

import gpucourse as gc
from _mutations import chapter_tests, solutions_namespace

_ONLINE = """\
m, l, acc = state
m_new = torch.maximum(m, scores.amax(dim=-1))
{body}
"""

_TILES = """\
n = world_size
def chunks(r):
    return (r,) if layout == "contiguous" else ({partner})
source = {source}
tiles = []
for a in chunks(rank):
    for b in chunks(source):
{rule}
return sorted(tiles)
"""
_RIGHT_RULE = """\
        if not causal or a > b:
            tiles.append((a, b, "full"))
        elif a == b:
            tiles.append((a, b, "diagonal"))"""


def _tiles(partner="r, 2 * n - 1 - r", source="(rank - step) % n", rule=_RIGHT_RULE):
    return _TILES.format(partner=partner, source=source, rule=rule)


_ROUTE = """\
num_tokens, num_experts = logits.shape
weights, experts = logits.softmax(dim=-1).topk(k, dim=-1)
{norm}
keep = torch.ones_like(experts, dtype=torch.bool)
if capacity_factor is not None:
    capacity = {capacity}
    used = [0] * num_experts
{loops}
            e = int(experts[t, j])
            if used[e] {cmp} capacity:
                used[e] += 1
            else:
                keep[t, j] = False
return weights, experts, keep
"""


def _route(norm="weights = weights / weights.sum(dim=-1, keepdim=True)",
           capacity="math.ceil(capacity_factor * num_tokens * k / num_experts)",
           loops="    for j in range(k):\n        for t in range(num_tokens):", cmp="<"):
    return _ROUTE.format(norm=norm, capacity=capacity, loops=loops, cmp=cmp)


VISIBLE = {
    "11.1": {
        "exp of the scores themselves (overflows)": _ONLINE.format(body="""\
safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
scale = torch.exp(m - safe)
p = torch.exp(scores) / torch.exp(safe).unsqueeze(-1)
return m_new, l * scale + p.sum(dim=-1), acc * scale.unsqueeze(-1) + p @ v"""),
        "NaN for a row with no visible key yet": _ONLINE.format(body="""\
scale = torch.exp(m - m_new)
p = torch.exp(scores - m_new.unsqueeze(-1))
return m_new, l * scale + p.sum(dim=-1), acc * scale.unsqueeze(-1) + p @ v"""),
        "no max subtracted (ported)": """\
m, l, acc = state
p = torch.exp(scores)                            # the max never subtracted: m stays 0
return torch.zeros_like(m), l + p.sum(dim=-1), acc + p @ v
""",
        "what the row had is not rescaled": _ONLINE.format(body="""\
safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
p = torch.exp(scores - safe.unsqueeze(-1))
return m_new, l + p.sum(dim=-1), acc + p @ v"""),
        "l rescaled, acc not": _ONLINE.format(body="""\
safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
scale = torch.exp(m - safe)
p = torch.exp(scores - safe.unsqueeze(-1))
return m_new, l * scale + p.sum(dim=-1), acc + p @ v"""),
        "the block's maximum, not the running one": """\
m, l, acc = state
m_new = scores.amax(dim=-1)
scale = torch.exp(m - m_new)
p = torch.exp(scores - m_new.unsqueeze(-1))
return m_new, l * scale + p.sum(dim=-1), acc * scale.unsqueeze(-1) + p @ v
""",
        "acc kept divided by l (the running output)": _ONLINE.format(body="""\
safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
scale = torch.exp(m - safe)
p = torch.exp(scores - safe.unsqueeze(-1))
l_new = l * scale + p.sum(dim=-1)
return m_new, l_new, (acc * (l * scale).unsqueeze(-1) + p @ v) / l_new.unsqueeze(-1)"""),
        "calls the forbidden helper": _ONLINE.format(body="""\
out_b, lse_b = torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)
out, lse = gc.merge_attention(acc / l.unsqueeze(-1), m + torch.log(l), out_b, lse_b)
l_new = torch.exp(lse - m_new)
return m_new, l_new, out * l_new.unsqueeze(-1)"""),
    },
    "11.2": {
        "always causal": _tiles(rule="""\
        if a > b:
            tiles.append((a, b, "full"))
        elif a == b:
            tiles.append((a, b, "diagonal"))"""),
        "the ring turned the wrong way (ported)": _tiles(source="(rank + step) % n"),
        # failed before, but with the structure's message ("expected a list of 1 item, got 0 items"), not the check's
        "one hop too many": _tiles(source="(rank - step - 1) % n"),
        "the diagonal counted as full": _tiles(rule="""\
        if not causal or a >= b:
            tiles.append((a, b, "full"))"""),
        "the zig-zag partner N - 1 - r": _tiles(partner="r, n - 1 - r"),
        "ranks compared, not chunks": _tiles(rule="""\
        if not causal or source < rank:
            tiles.append((a, b, "full"))
        elif source == rank and a == b:
            tiles.append((a, b, "diagonal"))
        elif source == rank and a > b:
            tiles.append((a, b, "full"))"""),
    },
    "11.3": {
        "no check of the lengths (ported)": """\
halves = [s.chunk(2, dim=2) for s in shards]
return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=2)
""",
        "concatenated in rank order": "return torch.cat(shards, dim=2)",
        "the late halves in rank order too": """\
halves = [s.chunk(2, dim=2) for s in shards]
return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=2)
""",
        "early and late swapped": """\
halves = [s.chunk(2, dim=2) for s in shards]
return torch.cat([h[1] for h in halves] + [h[0] for h in reversed(halves)], dim=2)
""",
        "the wrong dimension": """\
halves = [s.chunk(2, dim=-1) for s in shards]
return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=-1)
""",
        "calls the forbidden helper": "return gc.zigzag_merge(shards)",
    },
    "11.4": {
        "no limit forgotten": """\
num_tokens, num_experts = logits.shape
weights, experts = logits.softmax(dim=-1).topk(k, dim=-1)
weights = weights / weights.sum(dim=-1, keepdim=True)
keep = torch.ones_like(experts, dtype=torch.bool)
capacity = math.ceil(capacity_factor * num_tokens * k / num_experts)
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
        "two choices hard-coded": _route(loops="    for j in (0, 1):\n        for t in range(num_tokens):"),
        "floor, not ceil (ported)": _route(capacity="int(capacity_factor * num_tokens * k / num_experts)"),
        "each token's choices before the next token": _route(
            loops="    for t in range(num_tokens):\n        for j in range(k):"),
        "weights not renormalised": _route(norm="pass"),
        "one copy too many per expert": _route(cmp="<="),
        "calls the forbidden helper": """\
moe = gc.MoE(logits.shape[1], 1, logits.shape[1], top_k=k, capacity_factor=capacity_factor)
with torch.no_grad():
    moe.router.weight.copy_(torch.eye(logits.shape[1]))
    r = moe.route(logits)
return r.weights, r.experts, r.keep
""",
    },
    "11.5": {
        "each rank's experts sliced by their first and last id": """\
world_size, num_experts = counts.shape
send, recv = [], []
for o in torch.tensor_split(torch.arange(num_experts), world_size):
    lo, hi = int(o[0]), int(o[-1]) + 1          # a rank that owns no expert has no first id
    send.append(int(counts[rank, lo:hi].sum()))
mine = torch.tensor_split(torch.arange(num_experts), world_size)[rank]
recv = [int(counts[s, int(mine[0]):int(mine[-1]) + 1].sum()) for s in range(world_size)]
return send, recv
""",
        "assumes the experts divide evenly (ported)": """\
world_size, num_experts = counts.shape
per_rank = num_experts // world_size
owner = [min(e // per_rank, world_size - 1) for e in range(num_experts)]
send = [sum(int(counts[rank, e]) for e in range(num_experts) if owner[e] == r) for r in range(world_size)]
recv = [sum(int(counts[s, e]) for e in range(num_experts) if owner[e] == rank) for s in range(world_size)]
return send, recv
""",
        "chunk's ownership, not tensor_split's": """\
world_size, num_experts = counts.shape
owners = torch.arange(num_experts).chunk(world_size)
owners = list(owners) + [torch.arange(0)] * (world_size - len(owners))
by_rank = torch.stack([counts[:, o].sum(1) for o in owners], dim=1)
return by_rank[rank].tolist(), by_rank[:, rank].tolist()
""",
        "send and recv swapped": """\
world_size, num_experts = counts.shape
owners = torch.tensor_split(torch.arange(num_experts), world_size)
by_rank = torch.stack([counts[:, o].sum(1) for o in owners], dim=1)
return by_rank[:, rank].tolist(), by_rank[rank].tolist()
""",
        "copies to itself left out": """\
world_size, num_experts = counts.shape
owners = torch.tensor_split(torch.arange(num_experts), world_size)
by_rank = torch.stack([counts[:, o].sum(1) for o in owners], dim=1)
by_rank.fill_diagonal_(0)
return by_rank[rank].tolist(), by_rank[:, rank].tolist()
""",
    },
    "11.6": {
        "4 bytes a number, whatever the dtype": """\
rows = (sum(send) - send[rank]) + (sum(recv) - recv[rank])
one_way = rows * d_model * 4
return {"forward": one_way, "backward": one_way, "total": 2 * one_way}
""",
        "the other rank (ported)": """\
rows = send[1 - rank] + recv[1 - rank]
one_way = rows * d_model * dtype_bytes
return {"forward": one_way, "backward": one_way, "total": 2 * one_way}
""",
        "copies to itself counted": """\
one_way = (sum(send) + sum(recv)) * d_model * dtype_bytes
return {"forward": one_way, "backward": one_way, "total": 2 * one_way}
""",
        "only the dispatch": """\
one_way = (sum(send) - send[rank]) * d_model * dtype_bytes
return {"forward": one_way, "backward": one_way, "total": 2 * one_way}
""",
        "no backward": """\
one_way = (sum(send) - send[rank] + sum(recv) - recv[rank]) * d_model * dtype_bytes
return {"forward": one_way, "backward": 0, "total": one_way}
""",
        "calls the forbidden helper": """\
return gc.ep_comm_bytes(tokens=sum(send), d_model=d_model, world_size=len(send), top_k=1,
                        dtype_bytes=dtype_bytes, send_counts=send, recv_counts=recv, rank=rank)
""",
    },
}

HIDDEN = {
    "11.1": {
        "skips tiny rescales (the maximum rose by under 1e-3)": _ONLINE.format(body="""\
safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
rose = (m_new - m) > 1e-3                       # rescaling by exp(-0.0001) changes nothing much
scale = torch.where(rose | torch.isinf(m), torch.exp(m - safe), torch.ones_like(m))
p = torch.exp(scores - safe.unsqueeze(-1))
return m_new, l * scale + p.sum(dim=-1), acc * scale.unsqueeze(-1) + p @ v"""),
    },
    "11.2": {
        "(rank - step + 60) % n: 60 divides by every world size up to 6": _tiles(source="(rank - step + 60) % n"),
    },
    "11.3": {
        "a fixed table of 10 chunks (all that 5 ranks need)": """\
lengths = {s.shape[2] for s in shards}
if len(lengths) != 1 or next(iter(lengths)) % 2:
    raise ValueError("zig-zag shards have one even length along dim 2")
n = len(shards)
table = [None] * 10
for r, s in enumerate(shards):
    early, late = s.chunk(2, dim=2)
    table[r], table[2 * n - 1 - r] = early, late
return torch.cat([c for c in table if c is not None], dim=2)
""",
    },
    "11.4": {
        "a fixed table of 8 experts' loads": _route(loops="""\
    used = [0] * 8                              # one load per expert
    for j in range(k):
        for t in range(num_tokens):"""),
    },
    "11.5": {
        "a fixed table of 16 experts' owners": """\
world_size, num_experts = counts.shape
owner = [0] * 16                                # the rank that owns each expert
for r, o in enumerate(torch.tensor_split(torch.arange(num_experts), world_size)):
    for e in o.tolist():
        owner[e] = r
send, recv = [0] * world_size, [0] * world_size
for e in range(16):
    if e < num_experts:
        send[owner[e]] += int(counts[rank, e])
        if owner[e] == rank:
            for s in range(world_size):
                recv[s] += int(counts[s, e])
return send, recv
""",
    },
    "11.6": {
        "int32 arithmetic (overflows at published sizes)": """\
rows = (sum(send) - send[rank]) + (sum(recv) - recv[rank])
one_way = int(torch.tensor(rows, dtype=torch.int32) * d_model * dtype_bytes)    # int32, as the counts come
return {"forward": one_way, "backward": one_way, "total": 2 * one_way}
""",
    },
}

(test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
 test_trivial_answers_fail) = chapter_tests("11", VISIBLE, HIDDEN)


def test_solutions_agree_with_the_package():
    """The judge's reference is the course's answer: it must agree with what the package computes."""
    ns = solutions_namespace("11")
    g = torch.Generator().manual_seed(0)
    # 11.1: the online softmax over blocks is attention over all keys, and equals merge_attention's lse
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k = torch.randn(2, 3, 11, 4, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, 11, 4, generator=g, dtype=torch.float64)
    scores = q @ k.transpose(-1, -2) / 2.0
    state = (torch.full((2, 3, 5), -math.inf, dtype=torch.float64), torch.zeros(2, 3, 5, dtype=torch.float64),
             torch.zeros(2, 3, 5, 4, dtype=torch.float64))
    for a, b in ((6, 11), (0, 2), (2, 6)):
        state = ns["online_step"](state, scores[..., a:b], v[..., a:b, :])
    m, l, acc = state
    torch.testing.assert_close(acc / l.unsqueeze(-1), F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(m + torch.log(l), torch.logsumexp(scores, dim=-1))
    # 11.2: the tiles' keys are the K/V chunks held, as gc.ring_kv_chunks says
    for n in (1, 2, 3, 4, 5):
        for layout in ("contiguous", "zigzag"):
            for rank in range(n):
                for step in range(n):
                    held = set(gc.ring_kv_chunks(rank, step, n, layout=layout))
                    tiles = ns["step_tiles"](rank, step, n, layout, False)
                    assert {b for _, b, _ in tiles} == held
                    causal = ns["step_tiles"](rank, step, n, layout, True)
                    local = gc.ring_tiles(rank, (rank - step) % n, n, 4, causal=True, layout=layout)
                    assert bool(causal) == bool(local), (n, layout, rank, step)
    # 11.3: the inverse of gc.zigzag_split, as gc.zigzag_merge
    x = torch.randn(1, 2, 24, 3, generator=g)
    for n in (1, 2, 3, 4, 6):
        shards = [gc.zigzag_split(x, r, n) for r in range(n)]
        assert torch.equal(ns["zigzag_unshard"](shards), gc.zigzag_merge(shards))
    # 11.4: gc.MoE's routing
    for cf, k_ in ((None, 2), (1.0, 2), (0.5, 1), (1.25, 3)):
        logits = torch.randn(13, 5, generator=g)
        moe = gc.MoE(5, 1, 5, top_k=k_, capacity_factor=cf)
        with torch.no_grad():
            moe.router.weight.copy_(torch.eye(5))
            r = moe.route(logits)
        w, e, keep = ns["route_with_capacity"](logits, k_, cf)
        assert torch.equal(e, r.experts) and torch.equal(keep, r.keep)
        torch.testing.assert_close(w, r.weights)
    # 11.6: gc.ep_comm_bytes
    for world, rank in ((2, 0), (3, 2), (5, 1)):
        send = torch.randint(0, 30, (world,), generator=g).tolist()
        recv = torch.randint(0, 30, (world,), generator=g).tolist()
        assert ns["predict_ep_bytes"](send, recv, rank, 16, 2) == gc.ep_comm_bytes(
            tokens=200, d_model=16, world_size=world, top_k=1, dtype_bytes=2, send_counts=send,
            recv_counts=recv, rank=rank)
