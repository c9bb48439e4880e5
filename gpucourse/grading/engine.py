"""Run one (already restored) notebook in a fresh kernel; collect what each check cell computed.

The kernel only *computes*; the verdict is the judge's (:mod:`.judge`), after the run::

    for each code cell:
        graded cell?  prime  ─► harness.prime(slot, inputs)       the grader's inputs, as data
        execute the cell (the student's code runs; the check cell calls gc.check_exercise)
        graded cell?  collect ◄─ harness.collect()                 the values, as data (or nothing)

so nothing the kernel prints, hides or replies decides a grade: a check passes only when the judge
finds the values it received equal to the course's answer on the same inputs. A time budget holds
for the whole notebook (each cell gets ``min(cell_timeout, time left)``), and one cell's output is
capped twice: in the kernel and here, before it is stored.

:func:`execute` runs inside the sandbox's shepherd process (:mod:`.sandbox`) and returns plain
JSON; the grader turns that into results.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import shutil
import tempfile
import time

import nbformat

from .graded_build import parse

__all__ = ["execute", "steady_channels"]

_HARNESS = "__import__('gpucourse.grading.harness', fromlist=['prime'])"
#: the most wire text kept for one slot (the harness refuses more; this guards the shepherd)
MAX_VALUES = 16 << 20


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


#: the longest one wait on a kernel's socket lasts before it looks again (see :func:`steady_channels`)
POLL_SLICE = 1.0


def steady_channels(kc, slice_s: float = POLL_SLICE) -> None:
    """Make ``kc``'s shell and iopub reads see every message within ``slice_s`` seconds.

    pyzmq's asyncio poll waits on the socket's file descriptor, which ZeroMQ signals
    *edge*-triggered; under load a wake-up can be missed, and the message then sits unread until the
    wait's own timeout — the whole cell's time. CI saw a 0.3 s cell take 198 s that way (the kernel
    idle, the reply in the socket). Waiting in short slices bounds that: each slice ends in a real
    ``zmq_poll``, which sees the message.
    """
    from queue import Empty

    for channel in (kc.shell_channel, kc.iopub_channel):
        get = channel.get_msg

        async def get_msg(timeout=None, _get=get, **kwargs):
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    return await _get(timeout=slice_s if left is None else min(slice_s, left), **kwargs)
                except Empty:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise

        channel.get_msg = get_msg


def steady_client_class():
    """``NotebookClient`` whose kernel client reads through :func:`steady_channels` (nbclient is
    imported on first use: the grader's own process does not need it)."""
    from nbclient import NotebookClient

    class SteadyClient(NotebookClient):
        async def async_start_new_kernel_client(self):
            kc = await super().async_start_new_kernel_client()
            steady_channels(kc)
            return kc

    return SteadyClient


def _error_line(ename, evalue) -> str:
    lines = (evalue or "").strip().splitlines()
    return f"{ename}: {lines[0] if lines else ''}".rstrip(": ")


def execute(nb, *, slots: dict, cwd: str, cell_timeout: float, notebook_timeout: float,
            output_limit: int, env: dict | None = None) -> dict:
    """Execute ``nb`` (modified in place) in a fresh kernel; return a JSON-able run record.

    ``slots`` maps the index of every graded cell to ``{"slot": "08.1", "payload": <the judge's
    cases reply, JSON text>}``. The record's ``values`` maps each slot to the wire text its cell
    produced (absent when the cell made none).
    """
    from jupyter_core.utils import ensure_async
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    # the budget starts when the kernel is ready (starting it is the grader's cost, not the notebook's)
    deadline = time.monotonic() + notebook_timeout + 600
    cells: list[dict] = [{"status": "not run", "error": "", "message": "", "seconds": 0.0}
                         for _ in nb.cells]
    record: dict = {"cells": cells, "values": {}, "fatal": "", "phases": {}}
    phases, t0 = record["phases"], time.time()

    class Client(steady_client_class()):
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

        async def silent(self, code: str, expression: str | None = None):
            """Run ``code`` quietly; the value of ``expression`` (a literal), or None."""
            msg_id = await ensure_async(self.kc.execute(code, silent=True, store_history=False,
                                                        user_expressions={"v": expression} if expression else {}))
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CellTimeoutError("the notebook's time budget ran out")
                msg = await self.kc.shell_channel.get_msg(timeout=min(left, cell_timeout))
                if msg["parent_header"].get("msg_id") == msg_id:
                    break
            if not expression:
                return None
            expr = msg["content"].get("user_expressions", {}).get("v", {})
            text = expr.get("data", {}).get("text/plain", "None") if expr.get("status") == "ok" else "None"
            if len(text) > 2 * MAX_VALUES:
                return None
            try:                # parsed under the grader's AST lock (graded_build.parse): threads
                value = ast.literal_eval(parse(text, "eval"))
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return None
            return value if isinstance(value, str) and len(value) <= MAX_VALUES else None

        async def run(self, env):
            nonlocal deadline
            async with self.async_setup_kernel(**({"env": env} if env else {})):
                record["kernel_pid"] = getattr(self.km.provisioner, "pid", None)
                await self.async_wait_for_reply(await ensure_async(self.kc.kernel_info()))
                msg_id = await ensure_async(self.kc.execute(
                    f"{_HARNESS}.install_graded({int(output_limit)})", silent=True, store_history=False))
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
                    slot = slots.get(index) or slots.get(str(index))
                    if slot:
                        await self.silent(f"{_HARNESS}.prime({slot['slot']!r}, {slot['payload']!r})")
                    await self.async_execute_cell(cell, index, execution_count=self.code_cells_executed + 1)
                    cells[index]["seconds"] = round(time.monotonic() - started, 3)
                    if slot:
                        values = await self.silent("", f"{_HARNESS}.collect()")
                        if values is not None:
                            record["values"][slot["slot"]] = values
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
    # the kernel talks over Unix sockets in a private folder: nothing listens on a network address
    sockets = tempfile.mkdtemp(prefix="gpucourse-grade-kernel-")
    km = _current_env_kernel_manager()
    km.transport, km.ip = "ipc", os.path.join(sockets, "kernel")
    client = Client(nb, km=km, timeout_func=timeout_of, allow_errors=True,
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
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    if t_stop[0]:
        phases["kernel_stop"] = round(time.time() - t_stop[0], 3)
    return record
