"""Pipeline communication: activations forward, gradients backward, with point-to-point send/recv.

In a pipeline across processes each stage talks only to its neighbours:

* forward: stage ``s`` sends its output (an activation) to stage ``s + 1``;
* backward: stage ``s + 1`` sends the gradient of the loss w.r.t. that activation back to ``s``.

Three details make it fast and safe:

1) **Sends are non-blocking** (``isend``): a stage hands its activation over and computes on. With
   blocking sends, two neighbours sending to each other at the same moment (1F1B does that) would
   wait for each other forever.
2) **Receives are posted early** (``irecv`` into a buffer of the known shape, :meth:`post_recv_forward`).
   gloo moves a message only once the receiver has asked for it; if the sender is already busy
   computing by then, its communication thread must first get a CPU — on a 2-core laptop that costs
   milliseconds per message. A receive posted before the sender sends completes without help.
3) **Each message is tagged** with its micro-batch and direction, so a forward of micro-batch 3 can
   never be taken for micro-batch 2.

This module is only the transport; which micro-batch moves when is the schedule's business
(:mod:`gpucourse.pipeline.schedule`, :func:`gpucourse.pipeline_step`). Pass ``trace=[]`` to get a
log of every send and receive.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["PipelineComm", "ReceiveAhead", "agree_with_neighbours"]


_HELLO_TAG, _HELLO_BYTES = 0, 2048     # the greeting of exchange_with_neighbours


def _tag(kind: str, microbatch: int) -> int:
    return 1 + 2 * microbatch + (0 if kind == "activation" else 1)


class PipelineComm:
    """Send/recv between neighbouring pipeline stages of the default process group.

    Args:
        ranks: the global ranks of this pipeline's stages in order (default: ``0 … world_size-1``).
            The calling process must be one of them; its position is its stage.
        trace: a list to append one line per message to (for learning and debugging), or ``None``.
        device: where receive buffers are allocated: ``"cpu"`` for gloo, this rank's
            ``cuda:<local_rank>`` for NCCL.

    Example (two processes, one stage each)::

        >>> import gpucourse as gc
        >>> def ping(rank, world_size):
        ...     comm = PipelineComm()
        ...     if comm.is_first:
        ...         comm.send_forward(torch.ones(2, 3), microbatch=0)
        ...     else:
        ...         return comm.recv_forward(microbatch=0, shape=(2, 3)).sum().item()
        ...     comm.wait()
        >>> gc.launch(ping, 2)
        [None, 6.0]

    .. warning::
        The receiver must know the shape (and dtype) of what it receives: in a pipeline that is the
        micro-batch size times the stage boundary's feature shape. A wrong shape makes gloo raise a
        size mismatch; a receive that no send matches waits until the launch timeout.
    """

    def __init__(self, ranks: Sequence[int] | None = None, trace: list | None = None,
                 device: str | torch.device = "cpu"):
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
        self.device = torch.device(device)
        self._pending: list = []    # (work, tensor) of sends in flight
        self._posted: dict = {}     # (what, microbatch) -> (work, buffer, stage) of posted receives

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
        payload = tensor.detach().contiguous()
        work = dist.isend(payload, self.ranks[stage], tag=_tag(what, microbatch))
        self._pending.append((work, payload))  # keep the tensor alive until the send completes
        self._log(f"send {what} mb {microbatch} {tuple(payload.shape)} -> stage {stage}")

    def _post(self, stage: int, microbatch: int, what: str, shape, dtype) -> None:
        key = (what, microbatch)
        if key in self._posted:
            raise RuntimeError(f"the receive of the {what} of micro-batch {microbatch} is already posted")
        buffer = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        work = dist.irecv(buffer, self.ranks[stage], tag=_tag(what, microbatch))
        self._posted[key] = (work, buffer, stage)

    def _recv(self, stage: int, microbatch: int, what: str, shape, dtype) -> torch.Tensor:
        key = (what, microbatch)
        if key not in self._posted:
            if shape is None:
                raise RuntimeError(f"no receive posted for the {what} of micro-batch {microbatch}: "
                                   f"post it first or pass shape=")
            self._post(stage, microbatch, what, shape, dtype)
        work, buffer, _ = self._posted.pop(key)
        work.wait()
        self._log(f"recv {what} mb {microbatch} {tuple(buffer.shape)} <- stage {stage}")
        return buffer

    def exchange_with_neighbours(self, to_prev: dict | None, to_next: dict | None
                                 ) -> tuple[dict | None, dict | None]:
        """Send a small JSON-able dict to each neighbour; return what they sent (previous, next).

        :func:`~gpucourse.pipeline_step` uses it to check, before any activation moves, that the
        neighbours run the same schedule on the same micro-batches — otherwise a receive that no send
        matches would wait until the launch timeout. Both neighbours must call it.

        Args:
            to_prev: for the previous stage (ignored on the first stage).
            to_next: for the next stage (ignored on the last stage).

        Example (two processes)::

            >>> import gpucourse as gc
            >>> def hello(rank, world_size):
            ...     return PipelineComm().exchange_with_neighbours({"from": rank}, {"from": rank})
            >>> gc.launch(hello, 2)
            [(None, {'from': 1}), ({'from': 0}, None)]

        .. warning::
            A neighbour that never calls it (or crashed before) leaves this call waiting until the
            launch timeout, like any receive.
        """
        sends, recvs = [], {}
        for name, message, stage, present in (("prev", to_prev, self.stage - 1, not self.is_first),
                                               ("next", to_next, self.stage + 1, not self.is_last)):
            if not present:
                continue
            data = json.dumps(message).encode()
            if len(data) > _HELLO_BYTES - 8:
                raise ValueError(f"the message for stage {stage} is {len(data)} bytes as JSON; "
                                 f"at most {_HELLO_BYTES - 8} fit")
            out = torch.zeros(_HELLO_BYTES, dtype=torch.uint8)
            out[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
            out[8:8 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
            out = out.to(self.device)
            sends.append((dist.isend(out, self.ranks[stage], tag=_HELLO_TAG), out))
            buffer = torch.empty(_HELLO_BYTES, dtype=torch.uint8, device=self.device)
            recvs[name] = (dist.irecv(buffer, self.ranks[stage], tag=_HELLO_TAG), buffer)
        got: dict = {"prev": None, "next": None}
        for name, (work, buffer) in recvs.items():
            work.wait()
            raw = bytes(buffer.cpu().tolist())
            got[name] = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")].decode())
        for work, _ in sends:
            work.wait()
        return got["prev"], got["next"]

    def send_forward(self, activation: torch.Tensor, microbatch: int) -> None:
        """Hand this stage's output for ``microbatch`` to the next stage (non-blocking)."""
        if self.is_last:
            raise RuntimeError("the last stage has no next stage to send activations to")
        self._send(activation, self.stage + 1, microbatch, "activation")

    def post_recv_forward(self, microbatch: int, shape: Sequence[int],
                          dtype: torch.dtype = torch.float32) -> None:
        """Ask now for the previous stage's output for ``microbatch`` (collect it with :meth:`recv_forward`)."""
        if self.is_first:
            raise RuntimeError("the first stage reads its input from the batch, not from a stage")
        self._post(self.stage - 1, microbatch, "activation", shape, dtype)

    def recv_forward(self, microbatch: int, shape: Sequence[int] | None = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Wait for the previous stage's output for ``microbatch`` (posted earlier, or now with ``shape``)."""
        if self.is_first:
            raise RuntimeError("the first stage reads its input from the batch, not from a stage")
        return self._recv(self.stage - 1, microbatch, "activation", shape, dtype)

    def send_backward(self, grad: torch.Tensor, microbatch: int) -> None:
        """Hand d(loss)/d(this stage's input) for ``microbatch`` back to the previous stage."""
        if self.is_first:
            raise RuntimeError("the first stage has no previous stage to send gradients to")
        self._send(grad, self.stage - 1, microbatch, "gradient")

    def post_recv_backward(self, microbatch: int, shape: Sequence[int],
                           dtype: torch.dtype = torch.float32) -> None:
        """Ask now for d(loss)/d(this stage's output) for ``microbatch`` from the next stage."""
        if self.is_last:
            raise RuntimeError("the last stage starts the backward from the loss")
        self._post(self.stage + 1, microbatch, "gradient", shape, dtype)

    def recv_backward(self, microbatch: int, shape: Sequence[int] | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Wait for d(loss)/d(this stage's output) for ``microbatch`` (posted earlier, or now with ``shape``)."""
        if self.is_last:
            raise RuntimeError("the last stage starts the backward from the loss")
        return self._recv(self.stage + 1, microbatch, "gradient", shape, dtype)

    def wait(self) -> None:
        """Wait until every message this stage sent has left (call before reusing buffers or exiting)."""
        if self._posted:
            raise RuntimeError(f"receives posted but never collected: {sorted(self._posted)}")
        for work, _tensor in self._pending:
            work.wait()
        self._pending.clear()


class ReceiveAhead:
    """The receives one stage needs in a step, posted ``window`` ahead of use (detail 2 above).

    :func:`~gpucourse.pipeline_step` asks it for the next activation (:meth:`forward`) or gradient
    (:meth:`backward`); behind that call the buffer was posted long before, and collecting it posts
    the next one, so there are always ``window`` receives waiting for a neighbour's send.

    Args:
        comm: this stage's transport.
        ops: the stage's operations in schedule order (``schedule.ops[stage]``).
        sizes: samples per micro-batch.
        in_shape, out_shape: per-sample shape of the stage's input and output.
        dtype: dtype on the wire.
        window: receives kept posted (the stage's peak micro-batches in flight, plus one).

    Example (what a middle stage of a 3-stage GPipe posts first)::

        >>> from gpucourse.pipeline.schedule import gpipe_schedule
        >>> class FakeComm:                     # records instead of talking to a process
        ...     is_first = is_last = False
        ...     def post_recv_forward(self, i, shape, dtype): print("post activation", i, shape)
        ...     def post_recv_backward(self, i, shape, dtype): print("post gradient", i, shape)
        >>> _ = ReceiveAhead(FakeComm(), gpipe_schedule(3, 2).ops[1], [2, 2], (4,), (5,),
        ...                  torch.float32, window=2).start()
        post activation 0 (2, 4)
        post activation 1 (2, 4)
    """

    def __init__(self, comm: PipelineComm, ops, sizes: Sequence[int], in_shape, out_shape,
                 dtype: torch.dtype, *, window: int):
        self.comm, self.sizes, self.dtype, self.window = comm, list(sizes), dtype, window
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        # the receives this stage will need, in order: activations unless first, gradients unless last
        self.needs = [op for op in ops if (op.kind == "F" and not comm.is_first)
                      or (op.kind == "B" and not comm.is_last)]
        self.posted = self.received = 0

    def start(self) -> "ReceiveAhead":
        self._post_upto(self.window)
        return self

    def _post_upto(self, upto: int) -> None:
        while self.posted < min(upto, len(self.needs)):
            op = self.needs[self.posted]
            size = self.sizes[op.microbatch]
            if op.kind == "F":
                self.comm.post_recv_forward(op.microbatch, (size, *self.in_shape), self.dtype)
            else:
                self.comm.post_recv_backward(op.microbatch, (size, *self.out_shape), self.dtype)
            self.posted += 1

    def _collected(self, tensor: torch.Tensor) -> torch.Tensor:
        self.received += 1
        self._post_upto(self.received + self.window)
        return tensor

    def forward(self, microbatch: int) -> torch.Tensor:
        """The previous stage's activation for ``microbatch``."""
        return self._collected(self.comm.recv_forward(microbatch))

    def backward(self, microbatch: int) -> torch.Tensor:
        """The next stage's gradient for ``microbatch``."""
        return self._collected(self.comm.recv_backward(microbatch))


def agree_with_neighbours(comm: PipelineComm, schedule, *, batch_size: int, total_samples: int,
                          in_shape, out_shape, dtype) -> None:
    """Exchange what each stage was told with its neighbours; raise if they differ.

    Stages given different schedules, micro-batch counts or batch sizes would post receives that no
    send matches and wait forever; one small message each way turns that into a clear error.
    """
    mine = {"schedule": schedule.name, "operations": zlib.crc32(str(schedule).encode()),
            "stages": schedule.num_stages, "micro-batches": schedule.num_microbatches,
            "batch_size": batch_size, "total_samples": total_samples, "dtype": str(dtype)}
    in_shape, out_shape = [int(d) for d in in_shape], [int(d) for d in out_shape]
    prev, nxt = comm.exchange_with_neighbours({**mine, "boundary shape": in_shape},
                                              {**mine, "boundary shape": out_shape})
    for other, stage, boundary in ((prev, comm.stage - 1, in_shape), (nxt, comm.stage + 1, out_shape)):
        if other is None:
            continue
        ours = {**mine, "boundary shape": boundary}
        diff = [f"{k} {ours[k]!r} here, {other.get(k)!r} there" for k in ours
                if k != "operations" and ours[k] != other.get(k)]
        if not diff and ours["operations"] != other.get("operations"):
            diff = [f"schedules both named {schedule.name!r} order their operations differently"]
        if diff:
            raise RuntimeError(
                f"stage {comm.stage} and stage {stage} were given different pipelines: "
                + "; ".join(diff) + ". Call pipeline_step on every stage with the same schedule "
                "(name and micro-batches), batch_size, total_samples and dtype, and with in_shape equal "
                "to the previous stage's out_shape")
