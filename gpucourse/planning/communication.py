"""Chapter 11's byte counters, as the planner uses them (keyword arguments only, CONTRACT_11_12).

Until chapter 11 (``long_context/``, ``experts/``) is merged, the private ``_ch11_fallback`` module
stands in with the same signatures. TEMPORARY: at merge, keep only the two imports from the parts.
"""

try:                                                    # chapter 11 merged
    from ..long_context import cp_comm_bytes
except ImportError:                                     # TEMPORARY, delete at merge
    from ._ch11_fallback import cp_comm_bytes
try:
    from ..experts import ep_comm_bytes
except ImportError:                                     # TEMPORARY, delete at merge
    from ._ch11_fallback import ep_comm_bytes

__all__ = ["cp_comm_bytes", "ep_comm_bytes"]
