"""Pipeline communication: activations forward, gradients backward, with point-to-point send/recv.

In a pipeline across processes each stage talks only to its neighbours:

* forward: stage ``s`` sends its output (an activation) to stage ``s + 1``;
* backward: stage ``s + 1`` sends the gradient of the loss w.r.t. that activation back to ``s``.

The receiver must allocate a buffer of the right shape before ``recv``, and micro-batches may differ
in size, so every message is a small header (dtype, micro-batch id, shape) followed by the payload.
Sends are non-blocking (``isend``): a stage hands its activation over and computes on, which is what
lets neighbouring stages overlap — and with blocking sends two neighbours sending to each other at
the same time could wait for each other forever.

This module is only the transport; which micro-batch moves when is the schedule's business
(:mod:`gpucourse.pipeline_schedule`, :mod:`gpucourse.pipeline_parallel`). Pass ``trace=[]`` to get
a log of every send and receive.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["PipelineComm"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_MAX_DIMS = 8
_HEADER = 3 + _MAX_DIMS  # dtype code, micro-batch id, ndim, shape (padded)


class PipelineComm:
    """Send/recv between neighbouring pipeline stages of the default process group.

    Args:
        ranks: the global ranks of this pipeline's stages in order (default: ``0 … world_size-1``).
            The calling process must be one of them; its position is its stage.
        trace: a list to append one line per message to (for learning and debugging), or ``None``.

    Example (two processes, one stage each)::

        >>> import gpucourse as gc
        >>> def ping(rank, world_size):
        ...     comm = PipelineComm()
        ...     if comm.is_first:
        ...         comm.send_forward(torch.ones(2, 3), microbatch=0)
        ...     else:
        ...         return comm.recv_forward(microbatch=0).sum().item()
        ...     comm.wait()
        >>> gc.launch(ping, 2)
        [None, 6.0]

    .. warning::
        Send and receive must pair up in the same order on both sides. A stage that waits for
        micro-batch 3 while its neighbour sends micro-batch 2 is a schedule bug; the header catches
        it and raises instead of silently mixing up micro-batches.
    """

    def __init__(self, ranks: Sequence[int] | None = None, trace: list | None = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("PipelineComm needs a process group: call it inside a function started "
                               "by gc.launch, or after torch.distributed.init_process_group()")
        self.ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
        rank = dist.get_rank()
        if rank not in self.ranks:
            raise ValueError(f"this process (rank {rank}) is not one of the pipeline's ranks {self.ranks}")
        self.stage = self.ranks.index(rank)
        self.num_stages = len(self.ranks)
        self.trace = trace
        self._pending: list = []

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def _log(self, text: str) -> None:
        if self.trace is not None:
            self.trace.append(f"stage {self.stage}: {text}")

    def _send(self, tensor: torch.Tensor, stage: int, microbatch: int, what: str) -> None:
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ValueError(f"cannot send a {tensor.dtype} tensor of {tensor.dim()} dims; "
                             f"supported: {_DTYPES}, at most {_MAX_DIMS} dims")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1], header[2] = _DTYPES.index(tensor.dtype), microbatch, tensor.dim()
        header[3:3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        payload = tensor.detach().contiguous()
        dst = self.ranks[stage]
        # keep the tensors referenced until the sends complete (see wait())
        self._pending += [(dist.isend(header, dst), header), (dist.isend(payload, dst), payload)]
        self._log(f"send {what} mb {microbatch} {tuple(tensor.shape)} -> stage {stage}")

    def _recv(self, stage: int, microbatch: int, what: str) -> torch.Tensor:
        src = self.ranks[stage]
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.recv(header, src)
        dtype, got, ndim = _DTYPES[int(header[0])], int(header[1]), int(header[2])
        if got != microbatch:
            raise RuntimeError(f"stage {self.stage} expected the {what} of micro-batch {microbatch} "
                               f"from stage {stage} but received micro-batch {got}: the two stages "
                               "run different schedules")
        buffer = torch.empty(header[3:3 + ndim].tolist(), dtype=dtype)
        dist.recv(buffer, src)
        self._log(f"recv {what} mb {microbatch} {tuple(buffer.shape)} <- stage {stage}")
        return buffer

    def send_forward(self, activation: torch.Tensor, microbatch: int) -> None:
        """Hand this stage's output for ``microbatch`` to the next stage (non-blocking)."""
        if self.is_last:
            raise RuntimeError("the last stage has no next stage to send activations to")
        self._send(activation, self.stage + 1, microbatch, "activation")

    def recv_forward(self, microbatch: int) -> torch.Tensor:
        """Wait for the previous stage's output for ``microbatch``."""
        if self.is_first:
            raise RuntimeError("the first stage reads its input from the batch, not from a stage")
        return self._recv(self.stage - 1, microbatch, "activation")

    def send_backward(self, grad: torch.Tensor, microbatch: int) -> None:
        """Hand d(loss)/d(this stage's input) for ``microbatch`` back to the previous stage."""
        if self.is_first:
            raise RuntimeError("the first stage has no previous stage to send gradients to")
        self._send(grad, self.stage - 1, microbatch, "gradient")

    def recv_backward(self, microbatch: int) -> torch.Tensor:
        """Wait for d(loss)/d(this stage's output) for ``microbatch`` from the next stage."""
        if self.is_last:
            raise RuntimeError("the last stage starts the backward from the loss")
        return self._recv(self.stage + 1, microbatch, "gradient")

    def wait(self) -> None:
        """Wait until every message this stage sent has left (call before reusing buffers or exiting)."""
        for work, _tensor in self._pending:
            work.wait()
        self._pending.clear()
