"""Replicas that run forward *and* backward at the same time on CPU virtual devices.

PyTorch's autograd engine runs every CPU backward node on the thread that called ``backward()``, so
replica graphs built in worker threads would still be back-propagated one after another.
:func:`apply_concurrently` (the CPU path of :func:`~gpucourse.parallel_apply`) therefore

1) runs each replica's forward in its device's worker thread on *detached* stand-ins of its
   inputs and of its parameters/buffers (:class:`_Replica`), so each replica's graph is its own;
2) joins the replicas' outputs to the caller's graph through one autograd node
   (:class:`_ConcurrentBackward`) whose backward runs every replica's backward in that replica's
   worker thread, at the same time, into the stand-ins;
3) hands the gradients of the stand-ins back to the caller's graph, where they flow to the chunks
   (scatter's backward) and to the original parameters (replicate's backward sums them).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils import _pytree as pytree

from ..runtime import graph_nodes
from .device_workers import run_on_devices, span

__all__ = ["apply_concurrently"]


def apply_concurrently(modules: list[nn.Module], inputs: list[tuple], kwargs_tup: Sequence[dict],
                       devices: list[torch.device]) -> list[Any]:
    """Run ``modules[i](*inputs[i], **kwargs_tup[i])`` in the worker thread of ``devices[i]``, all at
    once, with a backward that runs in those threads too. Arguments are already checked.

    Example::

        >>> import gpucourse as gc
        >>> net, devs = torch.nn.Linear(3, 2), gc.virtual_devices(2)
        >>> x = torch.randn(4, 3, requires_grad=True)
        >>> outs = apply_concurrently(gc.replicate(net, devs), [(c,) for c in gc.scatter(x, devs)],
        ...                           [{}, {}], devs)
        >>> torch.cat(outs).sum().backward()            # both replicas back-propagate concurrently
        >>> torch.allclose(x.grad, net.weight.sum(0).expand(4, 3))
        True
    """
    # the same module object in several slots: its parameters are swapped for leaves during its
    # forward, so those replicas must take turns
    shared = _shared_lock(modules)
    replicas = [_Replica(i, m, tuple(a), dict(k), d)
                for i, (m, a, k, d) in enumerate(zip(modules, inputs, kwargs_tup, devices))]
    with span("wait for forward"):
        run_on_devices(lambda r: r.forward(shared), [(r,) for r in replicas], devices, label="forward")
    sources = [s for r in replicas for s in r.sources]
    if torch.is_grad_enabled() and any(r.diff_outputs for r in replicas):
        joined = iter(_ConcurrentBackward.apply(replicas, *sources))
        for r in replicas:
            swap = {id(o): next(joined) for o in r.diff_outputs}
            r.out_flat = [swap.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in r.out_flat]
    outputs = [r.out_flat[0] if r.out_spec is None else pytree.tree_unflatten(r.out_flat, r.out_spec)
               for r in replicas]
    for r in replicas:                   # keep only what backward needs
        r.out_flat = r.module = None
    return outputs


def _grad_slots(module: nn.Module) -> list[tuple[dict, str, torch.Tensor]]:
    """The module's parameters and buffers that require grad: (the dict holding it, key, tensor).

    For a replica from :func:`replicate`, its parameter copies (plain attributes) come from the
    list ``replicate`` recorded, so nothing has to be searched for.
    """
    recorded = module.__dict__.get("_gc_slots")
    if recorded is not None:
        slots = [(store, k, t) for store, k, t in recorded[0] if store.get(k) is t]
        modules = recorded[1]
    else:
        slots, modules = [], module.modules()
    for m in modules:
        for store in (m._parameters, m._buffers):
            if store:
                slots += [(store, k, t) for k, t in store.items() if t is not None and t.requires_grad]
    return slots


def _foreign_leaves(outputs: list[torch.Tensor], leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Leaf tensors requiring grad that ``outputs`` depend on, other than ``leaves``."""
    own = {id(t) for t in leaves}
    reached = (getattr(node, "variable", None) for node in graph_nodes(outputs))
    return [v for v in reached if v is not None and id(v) not in own]


class _Replica:
    """One replica's forward, run on detached leaves in its worker thread (CPU virtual devices)."""

    def __init__(self, index, module, args, kwargs, device):
        self.index, self.module, self.args, self.kwargs, self.device = index, module, args, kwargs, device
        self.outputs = None
        self.leaves: list[torch.Tensor] = []    # detached stand-ins, in the order of `sources`
        self.sources: list[torch.Tensor] = []   # the tensors of the caller's graph they stand for
        self.diff_outputs: list[torch.Tensor] = []

    def _stand_in(self, t):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            leaf = t.detach().requires_grad_()
            self.sources.append(t)
            self.leaves.append(leaf)
            return leaf
        return t

    def forward(self, lock: threading.Lock | None):
        grad = torch.is_grad_enabled()
        args, kwargs = self.args, self.kwargs
        if grad and not kwargs and all(type(a) is torch.Tensor for a in args):   # the common case
            args = tuple(self._stand_in(a) for a in args)
        elif grad:
            flat, spec = pytree.tree_flatten((args, kwargs))
            args, kwargs = pytree.tree_unflatten([self._stand_in(t) for t in flat], spec)
        with lock if lock is not None else contextlib.nullcontext():
            slots = _grad_slots(self.module) if grad else []
            for store, key, t in slots:
                leaf = t.detach().requires_grad_()
                self.sources.append(t)
                self.leaves.append(leaf)
                store[key] = leaf
            try:
                outputs = self.module(*args, **kwargs)
            finally:
                for store, key, t in slots:
                    store[key] = t
        if type(outputs) is torch.Tensor:
            out_flat, self.out_spec = [outputs], None
        else:
            out_flat, self.out_spec = pytree.tree_flatten(outputs)
        self.out_flat = out_flat
        self.diff_outputs = [t for t in out_flat if isinstance(t, torch.Tensor) and t.requires_grad]
        foreign = _foreign_leaves(self.diff_outputs, self.leaves)
        if foreign:
            shapes = [tuple(t.shape) for t in foreign[:3]]
            raise RuntimeError(
                f"the forward of replica {self.index} uses {len(foreign)} tensor(s) that require grad "
                f"but are neither arguments nor parameters/buffers of the module (shapes {shapes}); "
                "their gradients could not be computed. Pass them as arguments, or register them "
                "with nn.Parameter / register_buffer.")
        self.args = self.kwargs = None          # the chunks live on in the graph, not here
        return self

    def backward(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        pairs = [(o, g) for o, g in zip(self.diff_outputs, grads) if g is not None]
        if not pairs or not self.leaves:
            return [None] * len(self.leaves)
        outs, gs = zip(*pairs)
        # backward() into the stand-ins (every leaf of this graph is one: foreign leaves were refused),
        # not autograd.grad(), which torch.utils.checkpoint(use_reentrant=True) refuses
        torch.autograd.backward(outs, gs)
        result = [leaf.grad for leaf in self.leaves]  # None: unused, as autograd.grad(allow_unused=True)
        self.diff_outputs, self.leaves = [], []     # free this replica's graph
        return result


class _ConcurrentBackward(torch.autograd.Function):
    """Joins the replicas' detached graphs to the caller's graph; backward runs them concurrently."""

    @staticmethod
    def forward(ctx, replicas, *sources):
        ctx.replicas = replicas
        ctx.set_materialize_grads(False)
        return tuple(o.detach() for r in replicas for o in r.diff_outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        replicas = ctx.replicas
        if replicas is None:
            raise RuntimeError(
                "Trying to backward through a DataParallel step a second time: the replica graphs on "
                "virtual devices are freed by the first backward (retain_graph=True is not supported "
                "there). Run the forward again.")
        ctx.replicas = None
        per_replica, start = [], 0
        for r in replicas:
            per_replica.append(list(grads[start:start + len(r.diff_outputs)]))
            start += len(r.diff_outputs)
        with span("wait for backward"):
            results = run_on_devices(lambda r, g: r.backward(g), list(zip(replicas, per_replica)),
                                     [r.device for r in replicas], label="backward")
        return (None, *[g for grads_r in results for g in grads_r])


def _shared_lock(modules: list[nn.Module]) -> threading.Lock | None:
    if len({id(m) for m in modules}) == len(modules) and all("_gc_slots" in m.__dict__ for m in modules):
        return None                            # fresh replicas from replicate() never share
    owners: dict[int, int] = {}
    for i, m in enumerate(modules):
        for sub in m.modules():
            recorded = sub.__dict__.get("_gc_slots")
            own = chain(sub._parameters.values(), sub._buffers.values(),
                        (t for _, _, t in recorded[0]) if recorded else ())
            if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in own):
                continue                       # nothing of it is swapped: sharing is harmless
            if owners.setdefault(id(sub), i) != i:
                warnings.warn("parallel_apply got modules that share a submodule; those replicas run one "
                              "after another. Use gc.replicate(module, devices) to get one replica per "
                              "device.", stacklevel=4)
                return threading.Lock()
    return None
