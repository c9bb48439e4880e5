"""Chapter 07 — model and pipeline parallelism: stages on devices, micro-batches, schedules.

- ``model_split``        cut a model into stages on different devices
- ``gpipe``              GPipe in one process: micro-batches through the stages
- ``schedule``           GPipe and 1F1B schedules as data, the bubble
- ``pipeline_parallel``  the real pipeline across processes: ``pipeline_step``, one stage's schedule loop
- ``training``           its drivers: ``train_pipeline`` per rank, ``run_pipeline`` from the parent,
                         the one-process reference, and ``torch.distributed.pipelining``
- ``communication``      its transport: activations forward, gradients backward (send/recv), receives
                         posted ahead, the neighbours' agreement check
- ``step_recorder``      its instrumentation: timeline events, micro-batches in flight, saved bytes
- ``arguments``          a pipeline run's arguments, checked before any process starts
- ``grid``               data parallel × pipeline parallel ranks in a 2-D grid
- ``activation_memory``  bytes autograd keeps alive for backward, counted
"""

from .activation_memory import SavedActivationMeter
from .communication import PipelineComm
from .gpipe import GPipe, clock_cycles, merge_microbatches, split_microbatches
from .grid import ParallelGrid
from .model_split import (ModelParallel, TwoDeviceToyModel, balanced_partition, layer_costs,
                          split_sequential, training_state_bytes)
from .pipeline_parallel import make_schedule, pipeline_step
from .training import PipelineRun, run_pipeline, train_pipeline, train_sequential, train_torch_pipelining
from .schedule import (PipelineOp, PipelineSchedule, Timeline, TimelineEvent, bubble_fraction,
                       gpipe_schedule, one_f_one_b_schedule)

__all__ = ["SavedActivationMeter", "PipelineComm", "GPipe", "clock_cycles", "merge_microbatches",
           "split_microbatches", "ParallelGrid", "ModelParallel", "TwoDeviceToyModel", "balanced_partition",
           "layer_costs", "split_sequential", "training_state_bytes", "PipelineRun", "make_schedule",
           "pipeline_step", "run_pipeline", "train_pipeline", "train_sequential", "train_torch_pipelining",
           "PipelineOp", "PipelineSchedule", "Timeline", "TimelineEvent", "bubble_fraction",
           "gpipe_schedule", "one_f_one_b_schedule"]
