"""The runtime every part of the course stands on: start ranks, pick devices, time, print, check.

Nothing here imports another part of ``gpucourse``; every part may import from here.

- ``launcher``  ``launch(fn, nprocs)``: ranks as processes, from a script or a notebook cell; its
  plumbing: ``processes`` (fork/spawn, start, stop), ``rank_process`` (inside a rank),
  ``process_tree`` (every descendant), ``ports`` (the loopback store), ``rank_output`` (with
  ``hide_check_frames(fn)``: while a check runs, its cell's frames are not the learner's line);
  ``warm_parent()``: what a process imports once before it forks ranks (``torch._dynamo``)
- ``live_ranks``  ``start_ranks(n)``, ``%%ranks``, ``gc.ranks``: ranks that stay up between notebook
  cells; its plumbing: ``live_group`` (the group seen from the kernel, ``RankError``/``RankTimeout``),
  ``live_rank_process`` (inside a rank, and the keeper that cleans up after them)
- ``devices``   ``CUDA_VISIBLE_DEVICES`` remapping, CPU "virtual devices", ``default_backend()``, ``rank_device()``
- ``timing``    warm-up, repeats, median and ratios to a baseline
- ``printing``  rank-aware printing in rank order; ``in_kernel()``: are we in a notebook?
- ``validate``  the one argument checker of the package (messages name the value and what is allowed)
- ``cpu_features``  does this CPU multiply bf16 in hardware (AMX, AVX-512-bf16)?
- ``doctor``    ``python -m gpucourse doctor``
- ``exiting``   ``run_main(main)``: a torchrun script's last line (no SIGABRT at interpreter shutdown)
- ``autograd_graph``  ``graph_nodes(outputs)``: the autograd nodes behind a forward's outputs (which
  parameters it reached), ``output_tensors(outputs)`` the tensors in them (dataclasses too); ``EndOfBackward``: a callback at the end of the outermost backward
"""

from .cpu_features import bf16_hardware_note, cpu_supports_bf16, has_bf16_units
from .exiting import run_main
from .devices import cpu_cores, default_backend, rank_device, virtual_devices, visible_devices
from .groups import group_info
from .agreement import same_on_every_rank
from .autograd_graph import EndOfBackward, graph_nodes, output_tensors
from .launcher import WorkerError, free_port, launch
from .live_ranks import LiveRanks, RankError, RankTimeout, ranks, start_ranks
from .ports import listen_on
from .process_tree import reap_children
from .processes import warm_parent
from .rank_output import hide_check_frames
from .printing import in_kernel, print0, print_ordered, rank_prefix
from .timing import Timing, format_comparison, measure, speedup
from .validate import check_choice, check_int, check_number, check_positive, check_tensor, check_type

__all__ = ["bf16_hardware_note", "cpu_supports_bf16", "has_bf16_units", "cpu_cores", "default_backend", "rank_device",
           "virtual_devices", "visible_devices", "WorkerError", "free_port", "group_info", "same_on_every_rank", "launch",
           "LiveRanks", "RankError", "RankTimeout", "ranks", "start_ranks",
           "listen_on", "reap_children", "in_kernel", "print0", "print_ordered", "rank_prefix", "Timing", "format_comparison",
           "measure", "speedup", "check_choice", "check_int", "check_number", "check_positive",
           "check_tensor", "check_type", "hide_check_frames", "run_main", "EndOfBackward", "graph_nodes", "output_tensors", "warm_parent"]
