"""The autograd graph behind some outputs (which parameters a forward reached), and the end of a backward.

``graph_nodes(outputs)`` yields each node of the graph once, depth first from the outputs'
``grad_fn``. A leaf that requires grad shows up as its ``AccumulateGrad`` node, whose
``.variable`` is the leaf. The checks that make a forward's collectives agree between ranks
(MiniDDP, FullyShardedModule) and DataParallel's replicas (which leaves did a replica read?)
stand on it. ``EndOfBackward(callback)`` runs a callback at the end of the outermost backward, also
when a reentrant checkpoint nests backwards in it (MiniDDP's finish, ZeRO-2's and FSDP's last
reductions).

Example::

    >>> import torch
    >>> w, unused = torch.ones(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    >>> y = (w * 3).sum()
    >>> [node.variable is w for node in graph_nodes(y) if hasattr(node, "variable")]    # w, not unused
    [True]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import torch
from torch.utils._pytree import tree_leaves


def output_tensors(outputs) -> list[torch.Tensor]:
    """The tensors in a forward's ``outputs``: any pytree (tuple, list, dict, namedtuple) and the fields
    of dataclasses in it, as PyTorch DDP finds them (``_find_tensors``). ``tree_leaves`` alone sees a
    ``@dataclass`` output as one leaf that is not a tensor: the checks that stand on this found no
    tensor and refused nothing, and the ranks met in mismatched collectives.

        >>> import dataclasses
        >>> @dataclasses.dataclass
        ... class Out:
        ...     loss: torch.Tensor
        ...     extra: tuple
        >>> [t.tolist() for t in output_tensors({"out": Out(torch.ones(1), (torch.zeros(2), "note"))})]
        [[1.0], [0.0, 0.0]]
    """
    found, stack, seen = [], [outputs], set()
    while stack:
        for leaf in tree_leaves(stack.pop()):
            if isinstance(leaf, torch.Tensor):
                found.append(leaf)
            elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type) and id(leaf) not in seen:
                seen.add(id(leaf))
                stack.extend(getattr(leaf, f.name) for f in reversed(dataclasses.fields(leaf)))
    return found


def graph_nodes(outputs) -> Iterator[torch.autograd.graph.Node]:
    """Each autograd node that the tensors in ``outputs`` (see :func:`output_tensors`) depend on, once."""
    stack = [t.grad_fn for t in output_tensors(outputs) if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)


class EndOfBackward:
    """Run ``callback`` once at the end of each backward that called :meth:`arm` — the outermost one.

    ``torch.utils.checkpoint(use_reentrant=True)`` runs a backward of its own for each checkpointed
    segment, nested in the outer one, and autograd runs the final callbacks queued in that nested
    backward when *it* ends, before the outer layers' gradients have arrived. So a callback that
    finds itself at the end of a nested backward (the outer backward's node still running) puts
    itself back in the queue of the outer one, once that node is done.

    A backward that raises halfway never reaches its end: :attr:`pending` then stays true until the
    next outermost end or :meth:`forget`.

    Example::

        >>> import torch
        >>> ends = []
        >>> end = EndOfBackward(lambda: ends.append(len(ends)))
        >>> inner, outer = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
        >>> for p in [*inner.parameters(), *outer.parameters()]:
        ...     _ = p.register_post_accumulate_grad_hook(lambda p: end.arm())
        >>> h = torch.utils.checkpoint.checkpoint(inner, torch.ones(2, 3, requires_grad=True), use_reentrant=True)
        >>> outer(h).sum().backward()     # inner's hooks run in a backward nested in this one
        >>> ends                          # one end (the nested backward's end is not it)
        [0]
    """

    def __init__(self, callback):
        self.callback = callback
        self._tasks: set[int] = set()                 # graph tasks that armed and have not ended

    @property
    def pending(self) -> bool:
        """A backward armed this and has not reached its end (it may have raised)."""
        return bool(self._tasks)

    def arm(self) -> None:
        """From inside a backward (a hook): run the callback at its end. Once per backward."""
        task = torch._C._current_graph_task_id()
        if task in self._tasks:
            return
        self._tasks.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._end, task))

    def forget(self) -> None:
        """Drop what backwards that raised halfway left armed."""
        self._tasks.clear()

    def _end(self, task: int) -> None:
        self._tasks.discard(task)
        outer = torch._C._current_autograd_node()      # None: no backward encloses this one
        if outer is None:
            self._tasks.clear()                        # (and the ids of any that raised)
            self.callback()
            return
        handle = None

        def rearm(*_):                                 # in the outer backward, after its node
            handle.remove()
            self.arm()

        handle = outer.register_hook(rearm)
