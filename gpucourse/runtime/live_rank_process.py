"""Inside the live ranks of :mod:`~gpucourse.runtime.live_ranks`: the keeper and each rank's loop.

The process tree of one group, and why each level exists::

    kernel ──(pipe)── keeper ──┬── rank 0 ──(pipe to the kernel)   ... and whatever rank 0 starts
                               └── rank 1 ──(pipe to the kernel)

* :func:`keeper_main` — a fork of the kernel that forks the ranks and then only waits. It is a child
  subreaper, so everything a rank starts — even a daemon that double-forks, even after its rank
  died — stays below it. It reads one pipe from the kernel: a ``"stop"`` message, or end-of-file
  when the kernel is gone (exit, crash, ``kill -9``: the kernel's end of a pipe closes whatever
  kills it). Either way it SIGKILLs everything below it, reaps it, removes the group's folder and
  exits. It also reports each rank that exits (its status) to the kernel.
* :func:`rank_main` — one rank: joins the process group through the kernel's loopback store, then
  serves the kernel's commands (``exec`` a cell, ``gather`` a value, ``push`` values) in one
  namespace that lives as long as the rank. Its stdout/stderr go to files the kernel reads back
  (what a rank printed before it hung is not lost). It dies with the keeper (``PR_SET_PDEATHSIG``).

Messages are tuples over ``multiprocessing`` pipes (unix socket pairs, nothing on the network):

* kernel → rank: ``("port", port)`` once, then ``("exec", seq, code, filename)``,
  ``("gather", seq, expression, filename)``, ``("push", seq, pickled dict)``, ``("stop",)``;
* rank → kernel: ``("ready", pid, stdout offset, stderr offset)`` or ``("failed", traceback)``
  once, then for every command ``("done", seq, error, value, stdout offset, stderr offset,
  figures)`` where ``error`` is ``None`` or ``(exception type name, traceback text)``, ``value``
  the pickled plain value of a ``gather``, ``figures`` a list of PNG bytes;
* keeper → kernel: ``("exited", rank, exit status)`` (negative: killed by that signal).
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import faulthandler
import io
import linecache
import os
import pickle
import shutil
import signal
import sys
import time
import traceback

from .process_tree import LAUNCH_ID_VARIABLE, become_subreaper, kill_my_descendants, reap_children
from .rank_process import _linux_child_setup, _redirect_output

__all__ = ["CELL_PREFIX", "keeper_main", "plain", "rank_main"]

#: every cell's code is compiled under a file name starting with this (``<ranks cell 3>``)
CELL_PREFIX = "<ranks "
_POLL = 0.2            # s: how often the keeper looks for ranks that exited


# --- the keeper --------------------------------------------------------------------------------------

def keeper_main(kernel_conn, rank_conns, close_in_child, *, world_size: int, folder: str,
                launch_id: str, loopback: str | None, start_timeout: float) -> None:
    """Body of the keeper (never returns): fork the ranks, then wait for "stop" or the kernel's death."""
    os.setpgid(0, 0)                                   # the notebook's interrupt (SIGINT to the
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # kernel's process group) is not for us
    signal.signal(signal.SIGTERM, _exit_cleanly)       # asked to end: clean up first (see below)
    _quiet(os.path.join(folder, "keeper.log"))
    for conn in close_in_child:                        # the kernel's ends: only the kernel holds them
        conn.close()
    _linux_child_setup("gpucourse-keep", die_with_parent=False)   # it must outlive the kernel to clean up
    become_subreaper()
    me = os.getpid()
    pids = {}                                          # pid -> rank, of ranks not yet reaped
    for rank, conn in enumerate(rank_conns):
        pid = os.fork()
        if pid == 0:
            try:
                kernel_conn.close()
                for other in rank_conns:
                    if other is not conn:
                        other.close()
                rank_main(conn, rank, world_size, folder=folder, keeper=me, launch_id=launch_id,
                          loopback=loopback, start_timeout=start_timeout)
            finally:
                os._exit(70)
        pids[pid] = rank
    for conn in rank_conns:
        conn.close()
    try:
        _keep(kernel_conn, pids)
    finally:
        _stop_all(pids)
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(Exception):
            kernel_conn.send(("stopped",))
        os._exit(0)


def _exit_cleanly(signum, frame):
    raise SystemExit(0)                                # unwinds into keeper_main's cleanup


def _keep(kernel_conn, pids: dict[int, int]) -> None:
    """Wait for "stop" or end-of-file from the kernel; report ranks that exit meanwhile."""
    from multiprocessing.connection import wait

    while True:
        if wait([kernel_conn], timeout=_POLL):
            try:
                if kernel_conn.recv()[0] == "stop":
                    return
            except (EOFError, OSError):               # the kernel is gone
                return
        for pid, code in reap_children():
            rank = pids.pop(pid, None)
            if rank is not None:
                with contextlib.suppress(Exception):
                    kernel_conn.send(("exited", rank, code))


def _stop_all(pids: dict[int, int]) -> None:
    """SIGKILL every rank (its whole process group first) and everything below the keeper; reap all."""
    for pid in pids:                                   # not reaped yet: the pid is still ours
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    kill_my_descendants(seconds=5.0)                   # walks /proc below the keeper until empty
    deadline = time.monotonic() + 5.0                  # and reap what is left (ranks, adopted orphans)
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.005)
        except ChildProcessError:                      # no child left
            return


def _quiet(log_path: str) -> None:
    """The keeper writes nowhere but its own log (its stdout was the kernel's, a Jupyter stream)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)


# --- a rank --------------------------------------------------------------------------------------------

def rank_main(conn, rank: int, world_size: int, *, folder: str, keeper: int, launch_id: str,
              loopback: str | None, start_timeout: float) -> None:
    """Body of one live rank: set up, join the group, then serve the kernel's commands until told to stop."""
    # 1) own process group, named, dies with the keeper (and checks the keeper is still there:
    #    PR_SET_PDEATHSIG set after the keeper died would never fire)
    os.setpgid(0, 0)
    _linux_child_setup(f"gpucourse-rank{rank}")
    if os.getppid() != keeper:
        os._exit(71)
    become_subreaper()                          # what this rank starts stays below it (and the keeper)
    os.environ[LAUNCH_ID_VARIABLE] = launch_id
    out_path, err_path, stack_path = (os.path.join(folder, f"rank{rank}.{k}") for k in ("out", "err", "stack"))
    _redirect_output(out_path, err_path)
    faulthandler.enable(sys.stderr)
    if hasattr(signal, "SIGUSR1"):              # the kernel asks a hung rank where it is
        stack_file = open(stack_path, "w")      # noqa: SIM115 - open until the process ends
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)   # the kernel interrupts a busy cell
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _leave_the_notebook()

    # 2) join the group through the kernel's store (127.0.0.1), as gc.launch's ranks do
    if not conn.poll(start_timeout):
        os._exit(72)
    _, port = conn.recv()
    try:
        namespace = _join(rank, world_size, port, loopback, start_timeout)
    except BaseException:  # noqa: BLE001 - the kernel shows why
        conn.send(("failed", traceback.format_exc()))
        os._exit(73)
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(("ready", os.getpid(), os.lseek(1, 0, os.SEEK_CUR), os.lseek(2, 0, os.SEEK_CUR)))

    # 3) serve commands; variables live in `namespace` between cells
    _serve(conn, namespace)
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    kill_my_descendants()
    os._exit(0)


def _join(rank: int, world_size: int, port: int, loopback: str | None, timeout: float) -> dict:
    """Set torchrun's variables, join a gloo group at the kernel's store; return the cell namespace."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)                    # as gc.launch: OpenMP does not survive fork
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
        OMP_NUM_THREADS="1", TORCHELASTIC_USE_AGENT_STORE="True", TORCH_DIST_INIT_BARRIER="1")
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    client = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                           timeout=datetime.timedelta(seconds=timeout))
    # collectives get torch's default 30 min: a cell's own timeout decides when a rank hangs
    dist.init_process_group("gloo", store=dist.PrefixStore("gpucourse/live", client), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(minutes=30))
    main = type(sys)("__main__")                # a fresh __main__: cell-defined classes pickle by name
    main.__dict__.update(rank=rank, world_size=world_size, dist=dist, torch=torch)
    sys.modules["__main__"] = main
    return main.__dict__


def _leave_the_notebook() -> None:
    """Forget the kernel this process was forked from: its sockets belong to the kernel alone.

    ``IPython.display.display`` and ``get_ipython()`` find the kernel's shell object (copied by
    fork) and would publish on the kernel's sockets; without a shell, ``display`` prints text.
    Figures are drawn with Agg and sent back as PNG after each cell.
    """
    os.environ["MPLBACKEND"] = "agg"
    try:
        from IPython.core.interactiveshell import InteractiveShell
    except ImportError:
        InteractiveShell = None
    if InteractiveShell is not None and InteractiveShell.initialized():
        for cls in type(InteractiveShell.instance()).__mro__:
            if "_instance" in cls.__dict__:
                cls._instance = None
    if "matplotlib.pyplot" in sys.modules:
        with contextlib.suppress(Exception):
            plt = sys.modules["matplotlib.pyplot"]
            plt.close("all")                    # the kernel's open figures are not this rank's to show
            plt.switch_backend("agg")
    elif "matplotlib" in sys.modules:
        with contextlib.suppress(Exception):
            sys.modules["matplotlib"].use("agg", force=True)


def _serve(conn, namespace: dict) -> None:
    while True:
        try:
            message = conn.recv()
        except KeyboardInterrupt:               # an interrupt that arrived after the cell finished
            continue
        except (EOFError, OSError):             # the kernel is gone
            return
        if message[0] == "stop":
            return
        seq, error, value = message[1], None, None
        try:
            try:
                value = _command(message, namespace)
            except BaseException as e:  # noqa: BLE001 - every error goes back to the kernel
                error = (type(e).__name__, _format_error(e))
            figures = _figures()
            sys.stdout.flush()
            sys.stderr.flush()
            reply = ("done", seq, error, value, os.lseek(1, 0, os.SEEK_CUR), os.lseek(2, 0, os.SEEK_CUR),
                     figures)
        except KeyboardInterrupt:               # between the cell's end and the reply
            reply = ("done", seq, ("KeyboardInterrupt", "KeyboardInterrupt\n"), None,
                     os.lseek(1, 0, os.SEEK_CUR), os.lseek(2, 0, os.SEEK_CUR), [])
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return


def _command(message: tuple, namespace: dict):
    kind = message[0]
    if kind == "exec":
        _, _, code, filename = message
        dist = sys.modules.get("torch.distributed")
        had_group = dist is not None and dist.is_initialized()
        try:
            run_cell(code, namespace, filename)
        except ValueError as e:                         # a script's first lines, copied into a %%ranks cell
            if had_group and "initialize the default process group twice" in str(e):
                e.args = (f"{e} — live ranks start with their process group ready (gloo; `rank`, "
                          "`world_size` and `dist` are set): a %%ranks cell leaves out "
                          "dist.init_process_group",)
            raise
        if had_group and not dist.is_initialized():     # a script's last line, copied into a %%ranks cell
            raise RuntimeError(
                "this cell destroyed the live ranks' process group (dist.destroy_process_group()): a script "
                "ends with it, but live ranks keep their group from cell to cell, and every collective "
                "from now on would fail — gc.ranks.restart() starts a fresh group (gc.ranks.stop() ends them)")
        return None
    if kind == "gather":
        _, _, expression, filename = message
        value = eval(_compile(expression, filename, "eval"), namespace)
        return pickle.dumps(plain(value, expression), protocol=pickle.HIGHEST_PROTOCOL)
    if kind == "push":
        namespace.update(pickle.loads(message[2]))
        return None
    raise ValueError(f"unknown command {kind!r}")


def run_cell(code: str, namespace: dict, filename: str) -> None:
    """Run a cell as IPython does: statements, then the last expression's ``repr`` (unless ``;``)."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # source in tracebacks
    tree = ast.parse(code, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - running the cell is the point
    if last is not None:
        value = eval(compile(last, filename, "eval"), namespace)
        if value is not None:
            print(repr(value))


def _compile(source: str, filename: str, mode: str):
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return compile(source, filename, mode)


def _format_error(e: BaseException) -> str:
    """The traceback from the cell's first frame on (this loop's frames are machinery)."""
    tb = e.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith(CELL_PREFIX):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb))


def _figures() -> list[bytes]:
    """Every open pyplot figure as PNG, then closed (as the notebook's inline backend does)."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None or not plt.get_fignums():
        return []
    pngs = []
    for number in plt.get_fignums():
        buffer = io.BytesIO()
        plt.figure(number).savefig(buffer, format="png", bbox_inches="tight")
        pngs.append(buffer.getvalue())
    plt.close("all")
    return pngs


# --- plain data for gather -------------------------------------------------------------------------------

def plain(value, expression: str = "value"):
    """``value`` as plain, picklable data: tensors detached, on the CPU, with storage of their own.

    Allowed: ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, tensors (a
    ``DTensor`` becomes this rank's local shard), ``torch.dtype``/``torch.device``, ``torch.Size``
    (a tuple), numpy arrays and scalars, and lists, tuples, dicts, sets of these. Anything else
    raises ``TypeError`` naming what it found.

    Example::

        >>> import torch
        >>> big = torch.arange(10.0, requires_grad=True)
        >>> plain({"view": big[:2] * 2, "n": 3, "shape": big.shape})
        {'view': tensor([0., 2.]), 'n': 3, 'shape': (10,)}
    """
    import torch

    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, torch.Tensor):
        if type(value).__name__ == "DTensor" and hasattr(value, "to_local"):
            value = value.to_local()
        tensor = value.detach()
        if type(tensor) is not torch.Tensor:
            tensor = tensor.as_subclass(torch.Tensor)
        return tensor.cpu().clone()        # a view of a big storage would pickle all of it
    if isinstance(value, (torch.dtype, torch.device)):
        return value
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(value, numpy.ndarray) and value.dtype != object:
            return value.copy()
        if isinstance(value, numpy.generic):
            return value.item()
    if isinstance(value, (list, tuple)):
        items = [plain(v, expression) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, (set, frozenset)):
        return type(value)(plain(v, expression) for v in value)
    if isinstance(value, dict):
        return {plain(k, expression): plain(v, expression) for k, v in value.items()}
    raise TypeError(
        f"gather({expression!r}) found a {type(value).__module__}.{type(value).__qualname__}; "
        "gather returns plain data only: numbers, strings, tensors, numpy arrays and lists/tuples/"
        "dicts of them. Gather a part of it instead (model.state_dict(), loss.item(), x.shape)")
