"""Chapter 01 — serial vs parallel: chunk → run at the same time → merge, and the laws that bound it.

- ``parallel``       chunking, threads vs processes, a thread-safe merge
- ``cpu_control``    torch's intra-op threads, pinning a process to chosen cores
- ``amdahl``         Amdahl's and Gustafson's laws, fitted to measured runs
- ``vectorization``  SISD vs SIMD: a Python loop against one vectorised op
- ``roofline``       throughput, arithmetic intensity, when a GPU helps
- ``timeline``       which worker ran which chunk when
- ``workloads``      GIL-holding and GIL-releasing CPU work
"""

from .amdahl import (amdahl_speedup, amdahl_widget, fit_serial_fraction, gustafson_speedup, karp_flatt,
                     measure_scaling, plot_amdahl)
from .cpu_control import intra_op_threads, pinned_to_cpus
from .parallel import (SharedTotal, accumulate_in_threads, chunk_sizes, parallel_map, parallel_reduce,
                       split_into_chunks)
from .roofline import (ThroughputPoint, arithmetic_intensity, matmul_flops, measure_throughput, op_cost,
                       plot_roofline, plot_throughput, roofline)
from .timeline import ChunkRecord, Trace, plot_timelines
from .vectorization import cpu_capability, dot_loop, time_with_cpu_capability
from .workloads import python_work, torch_work

__all__ = ["amdahl_speedup", "amdahl_widget", "fit_serial_fraction", "gustafson_speedup", "karp_flatt",
           "measure_scaling", "plot_amdahl", "SharedTotal", "accumulate_in_threads", "chunk_sizes",
           "intra_op_threads", "parallel_map", "parallel_reduce", "pinned_to_cpus", "split_into_chunks",
           "ThroughputPoint", "arithmetic_intensity", "matmul_flops", "measure_throughput", "op_cost",
           "plot_roofline", "plot_throughput", "roofline", "ChunkRecord", "Trace", "plot_timelines",
           "cpu_capability", "dot_loop", "time_with_cpu_capability", "python_work", "torch_work"]
