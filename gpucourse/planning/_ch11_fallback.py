"""TEMPORARY — delete at merge with chapter 11 (the lead checks).

A private stand-in for chapter 11 part B's ``ep_comm_bytes`` (gpucourse/experts/), with the
contract's signature (CONTRACT_11_12.md). The planner imports the real one when it exists (see
``communication.py``); this is used only until then. (Part A's ``cp_comm_bytes`` has landed.)
"""

from __future__ import annotations

from ..runtime import check_int


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
