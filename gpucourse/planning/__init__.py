"""Chapter 12 — planning a real run: predict memory and step time of any split, rank the splits.

- ``model_spec``    ``ModelSpec``: parameters and FLOPs per token of a transformer; published presets
- ``cluster_spec``  ``ClusterSpec``: devices, memory, FLOP/s and two α-β links; presets; ``measure()`` here
- ``config``        ``ParallelConfig``: dp · tp · pp · cp · ep, ZeRO, micro-batches, recomputation
- ``memory``        model states (chapter 08's ZeRO formula) and saved activations (Korthikanti et al.)
- ``timing``        compute, each axis' communication (chapters 05, 08, 09, 11), the bubble (07), MFU
- ``predict``       ``predict`` one configuration; ``plan`` all of them, ranked, with the rejections
- ``plots``         ``plot_plan`` and ``plan_widget``, thin views over ``plan``
- ``communication`` chapter 11's byte counters as the planner calls them
"""

from .cluster_spec import ClusterSpec
from .config import ParallelConfig
from .memory import (activation_terms, inflight_microbatches, korthikanti_layer_bytes, layer_activation_bytes,
                     model_state_bytes, outside_activation_bytes, split_problem, stage_layers, stage_params)
from .model_spec import ModelSpec, training_flops_per_token
from .plots import plan_widget, plot_plan
from .predict import MemoryPrediction, Plan, Prediction, TimePrediction, plan, predict
from .timing import (bubble_time, compute_time, expert_imbalance_flops, cp_step_comm_time, dp_step_comm_time, ep_step_comm_time, exposed,
                     mfu, pp_step_comm_time, step_flops, tp_step_comm_time)

__all__ = ["ClusterSpec", "ParallelConfig", "ModelSpec", "training_flops_per_token", "activation_terms",
           "inflight_microbatches", "korthikanti_layer_bytes", "layer_activation_bytes", "model_state_bytes",
           "outside_activation_bytes", "split_problem", "stage_layers", "stage_params", "MemoryPrediction", "Plan",
           "Prediction", "TimePrediction", "plan", "predict", "bubble_time", "compute_time", "expert_imbalance_flops", "cp_step_comm_time",
           "dp_step_comm_time", "ep_step_comm_time", "exposed", "mfu", "plan_widget", "plot_plan",
           "pp_step_comm_time", "step_flops", "tp_step_comm_time"]
