"""Run one (already restored) notebook in a fresh kernel and decide which checks passed.

Pass means the kernel said ok::

    for each code cell:   execute ─► reply status (ok / error / none)   ◄─ nbclient's cell-executed hook
                          probe   ─► guard.report(): tampered names? which check nonces ran?
    a graded cell passes  ⇔  reply status "ok"  ∧  no error output  ∧  its nonce ran
                             ∧  nothing was tampered with before it

so hiding the error display (``set_custom_exc``, ``sys.excepthook``, an input transformer that turns
a check into ``pass``) cannot turn a failure into a pass. A time budget holds for the whole
notebook (each cell gets ``min(cell_timeout, time left)``), and one cell's output is capped twice:
in the kernel (the guard) and here, before it is stored.

:func:`execute` runs inside the sandbox's shepherd process (:mod:`.sandbox`) and returns plain
JSON; :func:`score` turns that into results in the grader.
"""

from __future__ import annotations

import ast
import asyncio
import json
import time
from dataclasses import dataclass

import nbformat

__all__ = ["GUARDED", "SlotResult", "execute", "names_used", "score"]

#: always verified, whatever the check's source says
GUARDED = ["torch.testing.assert_close", "torch.allclose", "torch.equal"]
_PROBE = "__import__('gpucourse.grading.guard', fromlist=['report']).report()"


def names_used(sources: list[str]) -> list[str]:
    """Dotted names rooted at a known module alias that the check sources use.

    Example::

        >>> names_used(["x = gc.launch(f, 2)\\ntorch.testing.assert_close(a, b)"])[:3]
        ['gc.launch', 'torch.allclose', 'torch.equal']
    """
    from .guard import ALIASES

    found = set(GUARDED)
    for src in sources:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            chain = []
            while isinstance(node, ast.Attribute):
                chain.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name) and chain and node.id in ALIASES:
                chain.reverse()
                if node.id == "gc":
                    chain = chain[:1]
                found.add(".".join([node.id, *chain]))
    return sorted(found)


def _current_env_kernel_manager():
    """A kernel manager that starts ipykernel with *this* interpreter (like nbval --nbval-current-env)."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class CurrentEnv(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                          **ipykernel.kernelspec.get_kernel_dict())

    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnv())


def _error_line(ename, evalue) -> str:
    lines = (evalue or "").strip().splitlines()
    return f"{ename}: {lines[0] if lines else ''}".rstrip(": ")


def execute(nb, *, names: list[str], cwd: str, cell_timeout: float, notebook_timeout: float,
            output_limit: int, env: dict | None = None) -> dict:
    """Execute ``nb`` (modified in place) in a fresh kernel; return a JSON-able run record."""
    from jupyter_core.utils import ensure_async
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    # the budget starts when the kernel is ready (starting it is the grader's cost, not the notebook's)
    deadline = time.monotonic() + notebook_timeout + 600
    cells: list[dict] = [{"status": "not run", "error": "", "message": "", "seconds": 0.0}
                         for _ in nb.cells]
    record: dict = {"cells": cells, "tampered": None, "ran": [], "fatal": "", "phases": {}}
    phases, t0 = record["phases"], time.time()

    class Client(NotebookClient):
        def output(self, outs, msg, display_id, cell_index):
            size = len(json.dumps(msg.get("content", {}), default=str)) if msg["msg_type"] in (
                "stream", "display_data", "execute_result", "update_display_data") else 0
            used = self._sizes.get(cell_index, 0) + size
            self._sizes[cell_index] = used
            # the kernel already cut at output_limit characters; this catches what bypassed that
            if output_limit > 0 and used > 2 * output_limit + 65536:
                if cell_index not in self._cut:
                    self._cut.add(cell_index)
                    outs.append(nbformat.v4.new_output(
                        "stream", name="stderr",
                        text=f"[output truncated by the grader after {used} bytes]\n"))
                return None
            return super().output(outs, msg, display_id, cell_index)

        async def probe(self):
            msg_id = await ensure_async(self.kc.execute("", silent=True, store_history=False,
                                                        user_expressions={"g": _PROBE}))
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CellTimeoutError("the notebook's time budget ran out")
                msg = await self.kc.shell_channel.get_msg(timeout=min(left, cell_timeout))
                if msg["parent_header"].get("msg_id") == msg_id:
                    break
            expr = msg["content"].get("user_expressions", {}).get("g", {})
            if expr.get("status") != "ok":
                return {"tampered": [f"the grader's guard could not run ({expr.get('ename', '?')})"],
                        "ran": []}
            return json.loads(ast.literal_eval(expr["data"]["text/plain"]))

        async def run(self, env):
            nonlocal deadline
            async with self.async_setup_kernel(**({"env": env} if env else {})):
                await self.async_wait_for_reply(await ensure_async(self.kc.kernel_info()))
                msg_id = await ensure_async(self.kc.execute(
                    f"__import__('gpucourse.grading.guard', fromlist=['install']).install("
                    f"{names!r}, {int(output_limit)})", silent=True, store_history=False))
                reply = await self.async_wait_for_reply(msg_id)
                if reply is None or reply["content"]["status"] != "ok":
                    record["fatal"] = "the grader could not prepare the kernel"
                    return
                deadline = time.monotonic() + notebook_timeout
                phases["kernel_start"] = round(time.time() - t0, 3)
                for index, cell in enumerate(self.nb.cells):
                    if cell.cell_type != "code" or not cell.source.strip():
                        cells[index]["status"] = "ok"
                        continue
                    started = time.monotonic()
                    if started >= deadline:
                        raise CellTimeoutError("budget")
                    await self.async_execute_cell(cell, index, execution_count=self.code_cells_executed + 1)
                    cells[index]["seconds"] = round(time.monotonic() - started, 3)
                    report = await self.probe()
                    record["ran"] = report["ran"]
                    if report["tampered"] and record["tampered"] is None:
                        record["tampered"] = {"cell": index, "what": report["tampered"]}
                phases["cells"] = round(time.time() - t0 - phases["kernel_start"], 3)
                t_stop[0] = time.time()

    def on_executed(cell, cell_index, execute_reply, **kw):
        content = (execute_reply or {}).get("content", {})
        row = cells[cell_index]
        row["status"] = content.get("status", "no reply")
        if row["status"] == "error":
            row["error"] = _error_line(content.get("ename"), content.get("evalue"))
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                row["error"] = row["error"] or _error_line(out.get("ename"), out.get("evalue"))
                row["message"] = (out.get("evalue") or "")[:2000]
                row["status"] = "error"
        if not row["message"] and row["status"] == "error":
            row["message"] = (content.get("evalue") or "")[:2000]

    def timeout_of(cell):
        return max(1, int(min(cell_timeout, deadline - time.monotonic()) + 0.999))

    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = Client(nb, km=_current_env_kernel_manager(), timeout_func=timeout_of, allow_errors=True,
                    record_timing=False, skip_cells_with_tag="\0never", on_cell_executed=on_executed,
                    iopub_timeout=10, raise_on_iopub_timeout=False, kernel_name="python3",
                    resources={"metadata": {"path": cwd}}, shutdown_kernel="immediate")
    client._sizes, client._cut = {}, set()
    t_stop = [0.0]
    try:
        asyncio.run(client.run(env))
    except CellTimeoutError:
        if time.monotonic() >= deadline - 0.5:
            record["fatal"] = f"the notebook ran longer than its budget of {notebook_timeout:g} s"
        else:
            record["fatal"] = f"a cell ran longer than {cell_timeout:g} s"
    except DeadKernelError as e:
        record["fatal"] = f"the kernel died ({str(e).splitlines()[0] if str(e) else 'killed'}; a " \
                          "resource limit, or the notebook ended its own process)"
    except Exception as e:  # noqa: BLE001 - the grader reports, never crashes, on one notebook
        record["fatal"] = f"grading stopped: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if t_stop[0]:
        phases["kernel_stop"] = round(time.time() - t_stop[0], 3)
    return record


@dataclass
class SlotResult:
    id: str
    title: str
    kind: str
    passed: bool
    error: str
    message: str
    seconds: float
    points: float


def score(record: dict, slots, origin: list) -> tuple[list[SlotResult], list[tuple[int, str]], str]:
    """Decide every graded cell. Returns (slot results, [(submission cell, error)] of other cells,
    notebook-level problem or "")."""
    cells = record["cells"]
    tampered = record.get("tampered")
    ran = set(record.get("ran", []))
    problem = ""
    if tampered:
        where = origin[tampered["cell"]] if tampered["cell"] < len(origin) else None
        cell = f"cell {where}" if where is not None else f"cell {tampered['cell']}"
        problem = f"tampered: {'; '.join(tampered['what'])} in {cell}"
    results = []
    for slot in slots:
        row = cells[slot.index] if 0 <= slot.index < len(cells) else {"status": "not run"}
        error = row.get("error", "")
        if slot.missing:
            error = f"exercise {slot.id} is missing from the submission"
        elif problem:
            error = problem
        elif row["status"] == "not run":
            error = "not run: " + (record.get("fatal") or "the notebook stopped before it")
        elif row["status"] != "ok":
            error = error or f"the kernel replied {row['status']!r}"
        elif row.get("error"):
            pass
        elif slot.nonce and slot.nonce not in ran:
            error = "the check did not run to its end (its code was changed while running)"
        results.append(SlotResult(slot.id, slot.title, slot.kind, not error, error,
                                  row.get("message", "") if not problem else "",
                                  row.get("seconds", 0.0), slot.points))
    graded = {s.index for s in slots}
    others = [(origin[i] if origin[i] is not None else i, row["error"]) for i, row in enumerate(cells)
              if i not in graded and row.get("error") and i < len(origin)]
    if record.get("fatal") and not problem:
        problem = record["fatal"]
    return results, others, problem
