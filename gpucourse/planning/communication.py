"""Chapter 11's byte counters, as the planner uses them (keyword arguments only).

``cp_comm_bytes`` is chapter 11 part A's (``long_context/``), ``ep_comm_bytes`` part B's
(``experts/``): the planner predicts the bytes with the very functions whose counts the ring and
the expert all-to-all are tested against, so there is one formula for each, not two.
"""

from ..experts import ep_comm_bytes
from ..long_context import cp_comm_bytes

__all__ = ["cp_comm_bytes", "ep_comm_bytes"]
