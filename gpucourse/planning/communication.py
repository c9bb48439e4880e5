"""Chapter 11's byte counters, as the planner uses them (keyword arguments only, CONTRACT_11_12).

``cp_comm_bytes`` is chapter 11 part A's (``long_context/``). Until part B (``experts/``) is merged,
the private ``_ch11_fallback`` module stands in for ``ep_comm_bytes`` with the same signature.
TEMPORARY: at merge, keep only the import from ``..experts`` and delete ``_ch11_fallback.py``.
"""

from ..long_context import cp_comm_bytes

try:
    from ..experts import ep_comm_bytes
except ImportError:                                     # TEMPORARY, delete at merge with chapter 11 part B
    from ._ch11_fallback import ep_comm_bytes

__all__ = ["cp_comm_bytes", "ep_comm_bytes"]
