"""Kernel side of the grader: snapshot what checks rely on, then report any change.

The engine runs :func:`install` in the fresh kernel *before* the first cell of the submission,
and calls :func:`report` (as a ``user_expressions`` entry, which no input transformer touches)
after every cell. ``report`` compares

- every name a check uses (``torch.testing.assert_close``, ``torch.allclose``, ``torch.equal``,
  ``gc.launch``, …), resolved the way the check resolves it — through the notebook's own globals —
  with the original object (identity, and for functions their code, defaults; for classes their
  attributes);
- IPython's input/AST transformer lists with their fresh-kernel contents;

and lists which check nonces really ran (:func:`ran` is appended to every graded cell).
Output of one cell is capped at ``output_limit`` characters here, before it reaches the grader.

.. warning::
   This stops rebinding and display tricks. Code that attacks the kernel from inside (patching
   this module, writing to the grader's pipes) is contained by the sandbox, not prevented.
"""

from __future__ import annotations

import importlib
import json
import sys

__all__ = ["ALIASES", "install", "ran", "report"]

#: how notebooks name modules → the module
ALIASES = {"gc": "gpucourse", "torch": "torch", "F": "torch.nn.functional", "dist": "torch.distributed",
           "nn": "torch.nn", "np": "numpy", "random": "random", "math": "math"}

_state: dict = {"names": {}, "transformers": None, "ran": [], "installed": False}


def _fingerprint(obj):
    """What must not change about an object a check calls."""
    if hasattr(obj, "__func__") and hasattr(obj, "__self__"):      # a bound method: new each access
        return ("method", _fingerprint(obj.__func__), id(obj.__self__))
    parts = [id(obj)]
    for attr in ("__code__", "__defaults__", "__kwdefaults__", "__wrapped__"):
        parts.append(id(getattr(obj, attr, None)) if not isinstance(obj, type) else 0)
    if isinstance(obj, type):
        parts.append(tuple(sorted((k, id(v)) for k, v in vars(obj).items() if not k.startswith("__"))))
    return tuple(parts)


def _resolve(root_obj, chain):
    obj = root_obj
    for attr in chain:
        obj = getattr(obj, attr)
    return obj


def _transformers(ip):
    m = ip.input_transformer_manager
    return [tuple(map(id, seq)) for seq in (ip.input_transformers_cleanup, ip.input_transformers_post,
                                            ip.ast_transformers, m.cleanup_transforms,
                                            m.line_transforms, m.token_transformers)]


def _cap_output(ip, limit: int) -> None:
    """Cut a cell's stdout/stderr after ``limit`` characters, before IPython or ipykernel keep it.

    IPython wraps ``sys.stdout.write`` anew for every cell (to keep outputs in its history) and
    restores it afterwards, so the cap is put on top of that wrapper at the start of every cell.
    """
    state = {"n": 0, "cut": False}

    def wrap(stream):
        write = stream.write

        def capped(s, *args, **kwargs):
            if not isinstance(s, str):
                return write(s, *args, **kwargs)
            if state["n"] >= limit:
                if not state["cut"]:
                    state["cut"] = True
                    write(f"\n[output truncated by the grader after {limit} characters]\n")
                return len(s)
            state["n"] += len(s)
            if state["n"] > limit:
                write(s[: len(s) - (state["n"] - limit)])
                return len(s)
            return write(s, *args, **kwargs)

        stream.write = capped

    def on_cell(*args):
        state.update(n=0, cut=False)
        for stream in (sys.stdout, sys.stderr):
            wrap(stream)

    ip.events.register("pre_run_cell", on_cell)


def install(names: list[str], output_limit: int) -> None:
    """Snapshot the originals of ``names`` (dotted, e.g. ``"gc.launch"``) and cap cell output."""
    from IPython import get_ipython

    ip = get_ipython()
    for dotted in names:
        root, *chain = dotted.split(".")
        try:
            module = importlib.import_module(ALIASES[root])
            _state["names"][dotted] = (ALIASES[root], chain, _fingerprint(_resolve(module, chain)))
        except Exception:
            continue                     # a name the check would not find either
    _state["transformers"] = _transformers(ip)
    _state["installed"] = True
    if output_limit > 0:
        _cap_output(ip, output_limit)


def ran(nonce: str) -> None:
    """Called as the last line of every graded cell."""
    _state["ran"].append(nonce)


def report() -> str:
    """JSON: ``{"tampered": [message, ...], "ran": [nonce, ...]}``."""
    from IPython import get_ipython

    ip = get_ipython()
    tampered = []
    if not _state["installed"]:
        tampered.append("the grader's guard was not installed")
    ns = ip.user_ns
    for dotted, (module_name, chain, fingerprint) in _state["names"].items():
        root = dotted.split(".")[0]
        if root not in ns:
            continue                                 # not imported (yet): the check fails by itself
        if ns[root] is not sys.modules.get(module_name):
            tampered.append(f"{root} was replaced")
            continue
        try:
            now = _fingerprint(_resolve(ns[root], chain))
        except AttributeError:
            tampered.append(f"{dotted} was deleted")
            continue
        if now != fingerprint:
            tampered.append(f"{dotted} was replaced")
    if _transformers(ip) != _state["transformers"]:
        tampered.append("IPython input transformers were changed")
    return json.dumps({"tampered": sorted(set(tampered)), "ran": list(_state["ran"])})
