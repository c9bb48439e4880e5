"""Chapter 10 — seeing and surviving real training: profiler traces, DDP options, restarts, DCP, Join.

- ``trace_timeline``          a ``torch.profiler`` Chrome trace read back: per-step backward and bucket
                              all-reduces (as ``StepTrace``), drawn; the share hidden under backward
- ``ddp_profiling``           profile DDP steps on each rank; DDP's options measured (bytes, time)
- ``fault_tolerance``         checkpoint everything a bit-identical resume needs; the latest checkpoint
- ``distributed_checkpoint``  DCP: sharded save, load on any number of ranks (FSDP2 ``fully_shard``)
- ``uneven_inputs``           ``Join`` for ranks with different numbers of batches
- ``parallel_3d``             the capstone: TinyGPT on a (pp, dp, tp) mesh — pipeline × ZeRO-1 × tensor parallel
- ``parallel_3d_runs``        its one-process reference, its launch, ``init_device_mesh``'s coordinates
"""

from .ddp_profiling import DDPOptionResult, measure_ddp_option, profile_ddp_steps
from .distributed_checkpoint import dcp_load, dcp_save, full_model_state, fully_shard_model
from .fault_tolerance import (
                              ResumableSampler,
                              latest_checkpoint,
                              load_training_state,
                              rng_states,
                              save_training_state,
                              set_rng_states,
)
from .trace_timeline import (
                              BucketOverlap,
                              OverlapReport,
                              allreduce_overlap,
                              hidden_fraction,
                              read_trace_events,
                              step_traces,
                              trace_timeline,
)
from .parallel_3d import MESH_DIMS, PipelineStage3D, train_3d
from .parallel_3d_runs import mesh_coordinates, run_3d, train_reference_3d
from .uneven_inputs import train_uneven

__all__ = [
                              "BucketOverlap",
                              "MESH_DIMS",
                              "PipelineStage3D",
                              "DDPOptionResult",
                              "OverlapReport",
                              "ResumableSampler",
                              "allreduce_overlap",
                              "dcp_load",
                              "dcp_save",
                              "full_model_state",
                              "fully_shard_model",
                              "hidden_fraction",
                              "latest_checkpoint",
                              "load_training_state",
                              "measure_ddp_option",
                              "mesh_coordinates",
                              "profile_ddp_steps",
                              "read_trace_events",
                              "rng_states",
                              "run_3d",
                              "save_training_state",
                              "set_rng_states",
                              "step_traces",
                              "trace_timeline",
                              "train_3d",
                              "train_reference_3d",
                              "train_uneven",
]
