"""Chapter 05 — multi-node initialisation: who am I, how do we meet, what does the network cost.

- ``dist_env``    a process's place in the job from torchrun / SLURM / OpenPAI variables
- ``rendezvous``  ``tcp://``, ``file://``, ``env://`` and clear errors when ranks cannot meet
- ``nodes``       several emulated nodes on one host, one launcher per node
- ``cost_model``  the α-β model of communication, fitted to measurements
- ``cost_measure``  the measurements: ping-pong and all-reduce times on this machine
- ``network``     interfaces, and a real slow link (netem) to try multi-node on
"""

from .cost_measure import measure_all_reduce, measure_point_to_point
from .cost_model import (LINKS, AlphaBeta, StepPrediction, fit_alpha_beta, predict_step_time,
                         ring_all_reduce_bytes, ring_all_reduce_time, scaling_table)
from .dist_env import DistEnv, dist_env_from, expand_slurm_nodelist, global_rank, rank_layout
from .network import EmulatedLink, emulated_link, netns_support, network_interfaces
from .nodes import NodeError, NodeResult, launch_nodes, torchrun_command
from .rendezvous import InitMethod, checked_init_process_group, parse_init_method

__all__ = ["LINKS", "AlphaBeta", "StepPrediction", "fit_alpha_beta", "measure_all_reduce",
           "measure_point_to_point", "predict_step_time", "ring_all_reduce_bytes", "ring_all_reduce_time",
           "scaling_table", "DistEnv", "dist_env_from", "expand_slurm_nodelist", "global_rank",
           "rank_layout", "EmulatedLink", "emulated_link", "netns_support", "network_interfaces",
           "NodeError", "NodeResult", "launch_nodes", "torchrun_command", "InitMethod",
           "checked_init_process_group", "parse_init_method"]
