"""Chapter 09 — tensor parallelism: one layer's matrices split across the ranks of a group.

- ``autograd_ops``  Megatron's conjugate pair f (identity / all-reduce) and g (all-reduce / identity)
- ``layers``        column- and row-parallel linear layers cut from a full ``nn.Linear``
- ``transformer``   the MLP, attention (by heads), embedding and tied head of ``gc.TinyGPT``, split
- ``vocab``         cross-entropy over a vocabulary split across ranks, without gathering logits
- ``comm_model``    bytes per step (``tp_comm_bytes``) and their α-β time; TP vs DP vs PP
- ``meter``         every collective of this part, counted (``comm_meter``)
- ``checks``        ranks that disagree fail together with a ``ValueError`` instead of hanging
- ``training``      TinyGPT on a 2-D mesh (tensor × data parallel) and in one process
"""

from .autograd_ops import (copy_to_tensor_parallel, gather_from_tensor_parallel, reduce_from_tensor_parallel,
                           scatter_to_tensor_parallel, tensor_split_sizes)
from .comm_model import parallelism_comm, tp_comm_bytes, tp_comm_time, tp_comm_widget
from .layers import ColumnParallelLinear, RowParallelLinear, column_parallel, row_parallel
from .meter import CommMeter, CommRecord, comm_meter
from .training import train_tinygpt, train_tinygpt_2d
from .transformer import (TensorParallelAttention, TensorParallelGPT, TensorParallelMLP, VocabParallelEmbedding,
                          tensor_parallel_attention, tensor_parallel_gpt, tensor_parallel_mlp)
from .vocab import vocab_parallel_cross_entropy

__all__ = ["copy_to_tensor_parallel", "gather_from_tensor_parallel", "reduce_from_tensor_parallel",
           "scatter_to_tensor_parallel", "tensor_split_sizes", "parallelism_comm", "tp_comm_bytes",
           "tp_comm_time", "tp_comm_widget", "ColumnParallelLinear", "RowParallelLinear", "column_parallel", "row_parallel",
           "CommMeter", "CommRecord", "comm_meter", "train_tinygpt", "train_tinygpt_2d",
           "TensorParallelAttention", "TensorParallelGPT", "TensorParallelMLP", "VocabParallelEmbedding",
           "tensor_parallel_attention", "tensor_parallel_gpt", "tensor_parallel_mlp",
           "vocab_parallel_cross_entropy"]
