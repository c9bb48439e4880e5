"""06.1 and 06.2 forbid PyTorch operators that do the whole exercise: graded, they do nothing.

``torch._amp_update_scale_`` is 06.1's answer in one call,
``torch._amp_foreach_non_finite_check_and_unscale_`` 06.2's. The kernel's gate could not stop them (an operator is no Python function to swap), and the
answer-cell scan saw only their names: each route below scored full marks on both exercises, visible
and hidden, until the graded build left them out (:mod:`gpucourse.grading.torch_ops`: a copy of
``libtorch_cpu.so`` in which they return at once, shown by the sandbox where the library is). Every
route's answer is right where torch is whole — checked here first, so a route that stops working on
its own cannot make the test pass.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
from _grading_helpers import grade_class

import gpucourse as gc
from gpucourse.grading import torch_ops
from gpucourse.grading.sandbox import isolation

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "solutions" / "06_mixed_precision_exercises.ipynb"
pytestmark = pytest.mark.skipif(isolation() != "bwrap", reason="the graded build needs bwrap "
                                "(Debian package bubblewrap)")

_GETATTR_061 = '''def next_scale(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5,
               growth_interval=2000):
    op = getattr(torch, "_amp_update" + "_scale_")
    s, t = torch.tensor([scale], dtype=torch.float32), torch.tensor([growth_tracker], dtype=torch.int32)
    op(s, t, torch.tensor([float(bool(found_inf))]), growth_factor, backoff_factor, growth_interval)
    return float(s), int(t)
'''

_GETATTR_062 = '''def unscale_and_step(optimizer, scale):
    op = getattr(torch, "_amp_foreach_non_finite" + "_check_and_unscale_")
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    found = torch.zeros(1)
    op(grads, found, torch.tensor(1.0 / scale))
    if found.item() == 0:
        optimizer.step()
        return True
    return False
'''

_ATEN_061 = _GETATTR_061.replace("getattr(torch,", "getattr(torch.ops.aten,")

#: GradScaler's methods called by a thread pool's own code: the kernel's gate takes them for the
#: course's (no learner frame calls them), so only the operators it is built on can stop it
_SCALER_IN_A_THREAD_062 = '''def unscale_and_step(optimizer, scale):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        scaler = pool.submit(getattr(torch.amp, "Grad" + "Scaler"), "cpu", init_scale=scale).result()
        pool.submit(scaler.scale, torch.ones(())).result()
        pool.submit(scaler.unscale_, optimizer).result()
        found = pool.submit(scaler._found_inf_per_device, optimizer).result()
        pool.submit(scaler.step, optimizer).result()
    return sum(v.item() for v in found.values()) == 0
'''

#: straight into the library: the exported CPU function, and the kernel its dispatch stub points to
_CTYPES_061 = '''def next_scale(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5,
               growth_interval=2000):
    import ctypes, os
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    fn = lib["_ZN2at6native22_amp_update_scale_cpu_ERNS_6TensorES2_RKS1_ddl"]
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_double, ctypes.c_double, ctypes.c_int64]
    s, t = torch.tensor([scale], dtype=torch.float32), torch.tensor([growth_tracker], dtype=torch.int32)
    f = torch.tensor([float(bool(found_inf))])
    cells = [ctypes.c_void_p(x._cdata) for x in (s, t, f)]
    fn(*[ctypes.addressof(c) for c in cells], growth_factor, backoff_factor, growth_interval)
    return float(s), int(t)
'''

_CTYPES_062 = '''def unscale_and_step(optimizer, scale):
    import ctypes, os
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    slot = ("_ZN2at6native12DispatchStubIPFvN3c108ArrayRefINS_6TensorEEERS4_RKS4_ENS0_72_"
            "amp_foreach_non_finite_check_and_unscale_cpu_stub_DECLARE_DISPATCH_typeEE7DEFAULTE")
    kernel = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)(
        ctypes.c_void_p.in_dll(lib, slot).value)
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    found, inv = torch.zeros(1), torch.tensor(1.0 / scale)
    array = (ctypes.c_void_p * len(grads))(*[g._cdata for g in grads])
    cells = [ctypes.c_void_p(x._cdata) for x in (found, inv)]
    kernel(ctypes.addressof(array), len(grads), *[ctypes.addressof(c) for c in cells])
    if found.item() == 0:
        optimizer.step()
        return True
    return False
'''

#: a fresh interpreter the notebook starts, without site or the notebook's environment (-I -S): no
#: hook in the kernel or in torch's Python files would run there
_FRESH_INTERPRETER_061 = r'''_server = []
def next_scale(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5,
               growth_interval=2000):
    import subprocess, sys
    if not _server:
        code = ("import sys; sys.path[:0] = %r\n" % sys.path
                + "import torch\nfor line in sys.stdin:\n    a = line.split()\n"
                + "    s = torch.tensor([float(a[0])]); t = torch.tensor([int(a[1])], dtype=torch.int32)\n"
                + "    getattr(torch, '_amp_update' + '_scale_')(s, t, torch.tensor([float(a[2])]), "
                + "float(a[3]), float(a[4]), int(a[5]))\n"
                + "    print(repr(s.item()), t.item(), flush=True)\n")
        _server.append(subprocess.Popen([sys.executable, "-I", "-S", "-c", code], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True))
    p = _server[0]
    print(repr(scale), growth_tracker, float(bool(found_inf)), growth_factor, backoff_factor, growth_interval,
          file=p.stdin, flush=True)
    out = p.stdout.readline().split()
    return float(out[0]), int(out[1])
'''

#: student → (06.1's answer, 06.2's answer); None keeps the course's
ROUTES = {"getattr": (_GETATTR_061, _GETATTR_062),
          "aten-and-a-scaler-in-a-thread": (_ATEN_061, _SCALER_IN_A_THREAD_062),
          "ctypes": (_CTYPES_061, _CTYPES_062),
          "fresh-interpreter": (_FRESH_INTERPRETER_061, None)}


def _answer_cells(nb) -> tuple[int, int]:
    return (next(i for i, c in enumerate(nb.cells) if c.source.startswith("def next_scale")),
            next(i for i, c in enumerate(nb.cells) if c.source.startswith("def unscale_and_step")))


def _solutions() -> dict:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    ns = {"torch": torch, "gc": gc, "math": math}
    for i in _answer_cells(nb):
        exec(nb.cells[i].source, ns)  # noqa: S102 - the course's own answers
    return ns


def _unscaled(fn, poison):
    torch.manual_seed(0)
    model = gc.MLP(5, 7, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    (model(torch.randn(4, 5)).sum() * 1024).backward()
    if poison is not None:
        next(model.parameters()).grad[1, 2] = poison
    stepped = fn(opt, 1024.0)
    return stepped, [t.detach().clone() for p in model.parameters() for t in (p, p.grad)]


def test_every_route_is_right_where_torch_is_whole():
    """The premise: in this process (torch whole) each route computes what the course's answers do."""
    want = _solutions()
    cases = [(s, k, inf, g, b, n) for s in (1024.0, 3.0, 2.0**126) for k in (0, 2) for inf in (False, True)
             for g, b, n in ((2.0, 0.5, 3), (1.5, 0.8, 1))]
    for student, (answer_061, answer_062) in ROUTES.items():
        ns = {"torch": torch}
        exec(answer_061, ns)  # noqa: S102 - the route under test
        for case in cases:
            got, expected = ns["next_scale"](*case), want["next_scale"](*case)
            assert got[1] == expected[1] and math.isclose(got[0], expected[0], rel_tol=1e-6), (student, case)
        if answer_062 is None:
            continue
        exec(answer_062, ns)  # noqa: S102
        for poison in (None, math.inf, math.nan):
            got = _unscaled(ns["unscale_and_step"], poison)
            expected = _unscaled(want["unscale_and_step"], poison)
            assert got[0] == expected[0], (student, poison)
            for a, b in zip(got[1], expected[1]):
                torch.testing.assert_close(a, b, equal_nan=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_route_to_a_forbidden_operator_scores_zero_and_honest_work_full_marks(tmp_path):
    nb0 = nbformat.read(NOTEBOOK, as_version=4)
    at_061, at_062 = _answer_cells(nb0)
    notebooks = {}
    for student, (answer_061, answer_062) in [*ROUTES.items(), ("honest", (None, None))]:
        nb = copy.deepcopy(nb0)
        nb.cells[at_061].source = answer_061 or nb.cells[at_061].source
        nb.cells[at_062].source = answer_062 or nb.cells[at_062].source
        notebooks[student] = (nb, NOTEBOOK.name)
    data = grade_class(tmp_path, notebooks)
    rows = {(r["student"], r["exercise"]): r for r in data["rows"]}
    for student, (answer_061, answer_062) in ROUTES.items():
        for exercise, answer, op in (
                ("06.1", answer_061, "torch._amp_update_scale_"),
                ("06.2", answer_062, "torch._amp_foreach_non_finite_check_and_unscale_")):
            r = rows[(student, exercise)]
            if answer is None:
                assert r["points"] == r["max"], r
                continue
            assert r["points"] == 0 and r["visible"] == "✗", r
            assert f"in which {op} does nothing" in r["error"], r         # the row says why
        for exercise in ("06.3", "06.4"):         # the exercises next to them: graded with a whole torch
            r = rows[(student, exercise)]
            assert r["points"] == r["max"], r
    for exercise in ("06.1", "06.2", "06.3", "06.4"):
        r = rows[("honest", exercise)]
        assert (r["visible"], r["hidden"], r["points"]) == ("✓", "✓", r["max"]), r
    honest = next(n for n in data["notebooks"] if n["student"] == "honest")
    assert honest["runs"] == 2, honest          # 06.3 needs GradScaler: a run of its own, with torch whole


def test_a_build_makes_only_the_forbidden_operators_do_nothing(tmp_path):
    """The copy of libtorch_cpu.so bound where the library is: the stripped operator leaves its
    arguments unchanged through every door, the other one and the rest of torch still work."""
    lib = torch_ops.write_library(["torch._amp_update_scale_"], tmp_path / "libtorch_cpu.so")
    probe = r"""
import torch
def update(op):
    s, t = torch.tensor([1024.0]), torch.tensor([0], dtype=torch.int32)
    op(s, t, torch.tensor([1.0]), 2.0, 0.5, 3)
    return s.item(), t.item()
print(update(torch._amp_update_scale_), update(torch.ops.aten._amp_update_scale_))
g = [torch.tensor([2.0, float("inf")])]
found = torch.zeros(1)
torch._amp_foreach_non_finite_check_and_unscale_(g, found, torch.tensor(0.5))
print(found.item(), g[0].tolist(), (torch.eye(2) @ torch.full((2, 2), 3.0)).sum().item())
"""
    bind = ["--ro-bind", str(lib), str(torch_ops.library_path())]
    run = subprocess.run(["bwrap", "--dev-bind", "/", "/", *bind, "--", sys.executable, "-c", probe],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["(1024.0, 0) (1024.0, 0)", "1.0 [1.0, inf] 12.0"], run.stdout
    with pytest.raises(LookupError, match="not an operator"):
        torch_ops.patches(["torch.matmul"])
