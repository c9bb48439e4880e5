"""Chapter 11 (part A) — context parallelism: one long sequence split across the ranks of a group.

- ``blockwise``   attention one block at a time: the online softmax, the log-sum-exp merge, one
  tile's forward and backward (readable matmul + softmax, or the fused op)
- ``zigzag``      who holds which chunk (contiguous, zig-zag) and which K/V block arrives when
- ``ring``        ring attention: K/V (and dK/dV) passed around the ring, one ``autograd.Function``
- ``ulysses``     DeepSpeed-Ulysses: all-to-all from sequence shards to head shards and back
- ``transport``   the isend/irecv pairs, the byte and step meter, the shape check that prevents hangs
- ``comm_model``  bytes per layer (``cp_comm_bytes``) and their α-β time on a link
"""

from .blockwise import attention_block, attention_block_backward, blockwise_attention, merge_attention
from .comm_model import cp_comm_bytes, cp_comm_time
from .ring import ring_attention, ring_tiles
from .transport import CPMeter, CPStep, cp_meter, ring_traces
from .ulysses import ulysses_attention
from .zigzag import ring_kv_chunks, zigzag_chunks, zigzag_merge, zigzag_split

__all__ = ["CPMeter", "CPStep", "attention_block", "attention_block_backward", "blockwise_attention",
           "cp_comm_bytes", "cp_comm_time", "cp_meter", "merge_attention", "ring_attention",
           "ring_kv_chunks", "ring_tiles", "ring_traces", "ulysses_attention", "zigzag_chunks",
           "zigzag_merge", "zigzag_split"]
