"""Chapter 11 (part B) — mixtures of experts and expert parallelism.

- ``moe``              the dense reference: router, top-k, capacity and dropped tokens, load-balancing loss
- ``expert_parallel``  experts split over ranks, tokens sent to them and back with all-to-all
- ``all_to_all``       the transport: a differentiable, counted all-to-all with uneven splits; the
                       header exchange that turns bad input into a ``ValueError`` on every rank
- ``comm_model``       bytes per layer (``ep_comm_bytes``) and their α-β time
- ``balance``          a short training run that shows what the load-balancing loss does
- ``axes``             the five parallelism axes side by side (``parallelism_axes``)
"""

from .axes import parallelism_axes
from .balance import load_balance_run
from .comm_model import ep_comm_bytes, ep_comm_time
from .expert_parallel import ExpertParallelMoE, expert_parallel
from .moe import MoE, Routing

__all__ = ["parallelism_axes", "load_balance_run", "ep_comm_bytes", "ep_comm_time", "ExpertParallelMoE", "expert_parallel", "MoE", "Routing"]
