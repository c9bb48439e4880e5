"""Live ranks in a real Jupyter kernel: the ``%%ranks`` magic, its output, errors that fail the
cell (and nbval), and ranks that die with the kernel — even when it is killed with SIGKILL."""

import ipaddress
import os
import signal
import subprocess
import sys
import textwrap

import nbformat
import pytest
from _kernel import REPO, kernel  # noqa: F401 - the fixture
from _processes import alive, children_of, comm, listeners_of, parent_of, wait_gone
from nbformat.v4 import new_code_cell, new_notebook


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")



def test_ranks_magic_in_a_kernel(kernel):
    status, out = kernel.run("import gpucourse as gc\ngroup = gc.start_ranks(2)\ngroup is gc.ranks")
    assert (status, out) == ("ok", [("execute_result", "True")])
    # every rank's output complete (stdout, then stderr) before the next rank's, labelled
    status, out = kernel.run("%%ranks\nimport sys\nt = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\n"
                             "print('sum', t)\nprint('note', rank, file=sys.stderr)\nt.item()")
    assert status == "ok"
    assert out == [("stdout", "[rank 0] sum tensor([3.])\n[rank 0] 3.0\n"), ("stderr", "[rank 0] note 0\n"),
                   ("stdout", "[rank 1] sum tensor([3.])\n[rank 1] 3.0\n"), ("stderr", "[rank 1] note 1\n")]
    assert kernel.run("%%ranks 1\nt += 1\nt") == ("ok", [("stdout", "[rank 1] tensor([4.])\n")])
    assert kernel.run("gc.ranks.gather('t.item()')") == ("ok", [("execute_result", "[3.0, 4.0]")])
    # a plot on rank 0 is a picture in the notebook
    status, out = kernel.run("%%ranks 0\nimport matplotlib.pyplot as plt\nplt.plot([1, 3, 2]);")
    assert status == "ok" and out == [("display_data", ["image/png", "text/plain"])]
    # an exception on a rank fails the cell; the traceback shown is the rank's, labelled
    status, out = kernel.run("%%ranks\nif rank == 1:\n    raise ValueError('bad batch')")
    assert status == "error"
    (kind, ename, evalue, tb), = out
    assert (kind, ename) == ("error", "RankError") and evalue.startswith("rank 1 raised ValueError: bad batch")
    assert "[rank 1]     raise ValueError('bad batch')" in "\n".join(tb)
    assert "live_ranks.py" not in "\n".join(tb)               # not the kernel-side frames that relayed it
    # a hang fails the cell with RankTimeout, then the group restarts
    status, out = kernel.run("%%ranks --timeout 2\nif rank == 0:\n    dist.barrier()")
    assert status == "error" and out[-1][1] == "RankTimeout" and "rank 0 still busy" in out[-1][2]
    status, out = kernel.run("%%ranks\nprint(rank)")
    assert status == "error" and "gc.ranks.restart()" in out[0][1]       # UsageError: say how to go on
    assert kernel.run("gc.ranks.restart(4).gather('world_size')") == ("ok", [("execute_result", "[4, 4, 4, 4]")])
    status, out = kernel.run("%%ranks 0,2 --timeout 30\nprint(rank)")
    assert (status, out) == ("ok", [("stdout", "[rank 0] 0\n[rank 2] 2\n")])
    status, out = kernel.run("%%ranks 7\nprint(rank)")
    assert status == "error" and "the group has ranks 0..3" in out[0][1]


@linux_only
def test_ranks_and_what_they_started_die_when_the_kernel_is_killed(kernel):
    status, out = kernel.run(textwrap.dedent("""
        import gpucourse as gc
        gc.start_ranks(2)
        gc.ranks.run('''
        import os, subprocess
        pids = [os.getpid(), subprocess.Popen(["sleep", "60"], start_new_session=True).pid]
        ''')
        print(sum(gc.ranks.gather("pids"), []))
        print(gc.ranks._group.folder)
    """))
    assert status == "ok", out
    printed, folder = out[0][1].strip().splitlines()
    pids = [int(p) for p in printed.strip("[]").split(",")]
    ranks = pids[0::2]
    keeper = parent_of(ranks[0])
    # found honestly: the ranks report their pids; /proc says whose children they are
    assert comm(keeper) == "gpucourse-keep" and parent_of(keeper) == kernel.pid
    assert all(parent_of(r) == keeper for r in ranks)
    assert sorted(children_of(keeper)) == sorted(ranks)
    family = [keeper, *pids]
    assert all(alive(p) for p in family)
    listening = listeners_of([kernel.pid, *family])          # the store (in the kernel) and gloo's
    assert len(listening) >= 3 and all(ipaddress.ip_address(a).is_loopback for a, _ in listening), listening
    try:
        os.kill(kernel.pid, signal.SIGKILL)
        left = wait_gone(family, 5)
        assert left == [], f"outlived the killed kernel: {[(p, comm(p)) for p in left]}"
        assert not os.path.exists(folder)
    finally:
        for pid in family:                      # never leave them running, whatever the outcome
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_nbval_fails_a_notebook_whose_rank_raises(tmp_path):
    error_cell = new_code_cell("%%ranks\nif rank == 1:\n    raise KeyError('x')")
    hang_cell = new_code_cell("%%ranks --timeout 2\nif rank == 0:\n    dist.barrier()")
    hang_cell.metadata["tags"] = ["raises-exception"]      # an expected hang, as a lesson shows one
    nb = new_notebook(cells=[
        new_code_cell("import gpucourse as gc\ngc.start_ranks(2);"),
        new_code_cell("%%ranks\nx = torch.ones(2) * rank\nx.sum().item()"),
        error_cell,
        hang_cell,
        new_code_cell("gc.ranks.restart()\ngc.ranks.gather('rank')"),
    ])
    path = tmp_path / "live.ipynb"
    nbformat.write(nb, path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:python", "-p", "no:cacheprovider",
                             "-q", "--nbval-lax", "--nbval-current-env", "-o", "addopts=", str(path)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "1 failed, 4 passed" in result.stdout, result.stdout[-3000:]
    assert "RankError" in result.stdout and "rank 1 raised KeyError" in result.stdout


def test_ranks_magic_is_known_after_import_in_a_fresh_kernel(kernel):
    """A fresh (or restarted) kernel that has only imported the package gets the course's message,
    not IPython's "Cell magic `%%ranks` not found"; importing starts no rank and imports no torch."""
    status, out = kernel.run("import sys, gpucourse as gc\n'torch' in sys.modules")
    assert (status, out) == ("ok", [("execute_result", "False")])
    status, out = kernel.run("%%ranks\nprint(rank)")
    assert (status, out) == ("error", [("stderr", "UsageError: no live ranks: they were never started: "
                                                  "call gc.start_ranks(n) first\n")]), out
    status, out = kernel.run("gc.start_ranks(2)\n")
    assert status == "ok", out
    assert kernel.run("%%ranks\nprint(rank)") == ("ok", [("stdout", "[rank 0] 0\n[rank 1] 1\n")])


def _execute_as_jupyterlab(kernel, code: str, timeout: float = 60) -> list[tuple]:
    """Run a cell the way JupyterLab sends it (its execute_request names the cell: ``cellId``);
    every iopub message of it, in order, as ``(type, content)``."""
    import time

    client = kernel.client
    msg = client.session.msg("execute_request", {"code": code, "silent": False, "store_history": True,
                                                 "user_expressions": {}, "allow_stdin": False,
                                                 "stop_on_error": True},
                             metadata={"cellId": "a1b2c3", "deletedCells": [], "recordTiming": False})
    client.shell_channel.send(msg)
    messages, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if m["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
            continue
        if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
            return messages
        if m["msg_type"] not in ("status", "execute_input"):
            messages.append((m["msg_type"], m["content"]))
    raise AssertionError(f"the cell did not end within {timeout} s: {messages}")


def test_a_ranks_cell_shows_each_rank_live_then_its_ordered_output(kernel):
    """While a %%ranks cell runs, a notebook shows a line per rank (running, done, its last print),
    updated in place; when the cell ends it is cleared and the rank-by-rank output takes its place.
    A frontend that keeps every output (nbval, nbclient: no cellId) gets the ordered output only."""
    assert kernel.run("import gpucourse as gc\ngc.start_ranks(2);")[0] == "ok"
    code = ("%%ranks\nimport time\nprint('loading', flush=True)\n"
            "time.sleep(0.2 if rank == 0 else 2.5)\nprint('ready', rank)")
    messages = _execute_as_jupyterlab(kernel, code)
    kinds = [kind for kind, _ in messages]
    assert kinds[0] == "display_data" and "clear_output" in kinds, kinds
    live = [c["data"]["text/plain"] for kind, c in messages if kind in ("display_data", "update_display_data")]
    assert any("[rank 0] done" in text and "[rank 1] running" in text and "last print: loading" in text
               for text in live), live
    ids = {c["transient"]["display_id"] for kind, c in messages if kind in ("display_data", "update_display_data")}
    assert len(ids) == 1                                     # one display, updated in place
    after = kinds[kinds.index("clear_output") + 1:]
    assert set(after) == {"stream"} and "display_data" not in after
    text = "".join(c["text"] for kind, c in messages[kinds.index("clear_output"):] if kind == "stream")
    assert text == "[rank 0] loading\n[rank 0] ready 0\n[rank 1] loading\n[rank 1] ready 1\n"
    # without a cellId (nbval, nbclient): the ordered output only, as the notebook stores it
    status, out = kernel.run(code)
    assert (status, out) == ("ok", [("stdout", text)])
    # Kernel → Interrupt during a %%ranks cell: not a bare KeyboardInterrupt, but what became of the ranks
    import threading

    timer = threading.Timer(1.5, kernel.km.interrupt_kernel)
    timer.start()
    messages = _execute_as_jupyterlab(kernel, "%%ranks\nimport time\ntime.sleep(30)")
    timer.join()
    (error,) = [c for kind, c in messages if kind == "error"]
    shown = "\n".join(error["traceback"])
    assert "KeyboardInterrupt" in shown and "ranks still live: ranks 0,1 interrupted" in shown, shown
    assert "live_ranks.py" not in shown, shown
    assert kernel.run("gc.ranks.gather('rank')") == ("ok", [("execute_result", "[0, 1]")])
