"""Walk the autograd graph behind some outputs: which parameters (leaves) a forward reached.

``graph_nodes(outputs)`` yields each node of the graph once, depth first from the outputs'
``grad_fn``. A leaf that requires grad shows up as its ``AccumulateGrad`` node, whose
``.variable`` is the leaf. The checks that make a forward's collectives agree between ranks
(MiniDDP, FullyShardedModule) and DataParallel's replicas (which leaves did a replica read?)
stand on it.

Example::

    >>> import torch
    >>> w, b = torch.ones(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    >>> y = (w * 3).sum()
    >>> [node.variable is w for node in graph_nodes(y) if hasattr(node, "variable")]
    [True]
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils._pytree import tree_leaves


def graph_nodes(outputs) -> Iterator[torch.autograd.graph.Node]:
    """Each autograd node that the tensors in ``outputs`` (any pytree) depend on, once."""
    stack = [t.grad_fn for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
