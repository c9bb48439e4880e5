"""TEMPORARY — delete at merge with chapter 11 (the lead checks).

Private stand-ins for chapter 11's ``cp_comm_bytes`` (gpucourse/long_context/) and ``ep_comm_bytes``
(gpucourse/experts/), with the contract's signatures (CONTRACT_11_12.md). The planner imports the
real ones when they exist (see ``communication.py``); these are used only until then.
"""

from __future__ import annotations

from ..runtime import check_choice, check_int


def cp_comm_bytes(*, batch, heads, seq, head_dim, world_size, method="ring", causal=False, kv_heads=None,
                  dtype_bytes=4):
    for name, v in (("batch", batch), ("heads", heads), ("seq", seq), ("head_dim", head_dim),
                    ("world_size", world_size), ("dtype_bytes", dtype_bytes)):
        check_int(name, v, 1)
    check_choice("method", method, ("ring", "ulysses"))
    kv_heads = heads if kv_heads is None else check_int("kv_heads", kv_heads, 1)
    n = world_size
    if seq % n:
        raise ValueError(f"seq ({seq}) must be divisible by world_size ({n})")
    shard = batch * (seq // n) * head_dim * dtype_bytes          # one head's slice of this rank's shard
    if method == "ring":
        kv = 2 * kv_heads * shard                                # K and V of this rank's shard
        forward = (n - 1) * kv                                   # passed n-1 times around the ring
        backward = (n - 1) * kv + n * kv                         # K, V again + dK, dV home (n hops)
    else:
        part = (n - 1) * shard // n                              # all-to-all keeps 1/n at home
        forward = (2 * heads + 2 * kv_heads) * part              # q, k, v in; output back
        backward = (2 * heads + 2 * kv_heads) * part
    return {"forward": forward, "backward": backward, "total": forward + backward}


def ep_comm_bytes(*, tokens, d_model, world_size, top_k, dtype_bytes=4, send_counts=None):
    for name, v in (("tokens", tokens), ("d_model", d_model), ("world_size", world_size), ("top_k", top_k),
                    ("dtype_bytes", dtype_bytes)):
        check_int(name, v, 1)
    if send_counts is not None:
        raise ValueError("the planner's temporary ep_comm_bytes takes no send_counts (chapter 11's does)")
    leaving = tokens * top_k * (world_size - 1) // world_size   # token copies that leave this rank
    one_way = leaving * d_model * dtype_bytes
    forward = 2 * one_way                                        # dispatch + combine
    return {"forward": forward, "backward": forward, "total": 2 * forward}
