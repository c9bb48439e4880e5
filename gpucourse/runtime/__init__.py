"""The runtime every part of the course stands on: start ranks, pick devices, time, print, check.

Nothing here imports another part of ``gpucourse``; every part may import from here.

- ``launcher``  ``launch(fn, nprocs)``: ranks as processes, from a script or a notebook cell; its
  plumbing: ``processes`` (fork/spawn, start, stop), ``rank_process`` (inside a rank),
  ``process_tree`` (every descendant), ``ports`` (the loopback store), ``rank_output``
- ``devices``   ``CUDA_VISIBLE_DEVICES`` remapping and CPU "virtual devices"
- ``timing``    warm-up, repeats, median and ratios to a baseline
- ``printing``  rank-aware printing in rank order
- ``validate``  the one argument checker of the package (messages name the value and what is allowed)
- ``doctor``    ``python -m gpucourse doctor``
"""

from .devices import cpu_cores, virtual_devices, visible_devices
from .launcher import WorkerError, free_port, launch
from .printing import print0, print_ordered, rank_prefix
from .timing import Timing, format_comparison, measure, speedup

__all__ = ["cpu_cores", "virtual_devices", "visible_devices", "WorkerError", "free_port", "launch",
           "print0", "print_ordered", "rank_prefix", "Timing", "format_comparison", "measure", "speedup"]
