"""Starting and stopping the rank processes of :func:`~gpucourse.launch`.

**How a rank starts: fork or spawn.** ``fork`` copies the running interpreter — a function defined
in a notebook cell included, and torch already imported (fast). But a forked child cannot use CUDA
once the parent has initialised it ("Cannot re-initialize CUDA in forked subprocess"), and
``torch.cuda.is_available()`` already initialises the CUDA *driver* without
``torch.cuda.is_initialized()`` saying so. So whenever CUDA may have been touched in this process,
or ``backend="nccl"`` will use it, ranks are forked by a *fork server* instead: a fresh interpreter
that imported torch once (and never touched CUDA), started at the first such launch and ending with
this process. A rank it forks starts in a fraction of a second, where a ``spawn``-ed one imports
torch afresh (seconds; ten or more on a busy GPU machine, for every rank of every launch). ``fn``
and ``args`` then travel *by value* with ``cloudpickle``, which can send what plain ``pickle``
sends only by name — functions and classes defined in a notebook cell, closures, lambdas — and the
rank takes this process's environment, working folder and ``sys.path`` as they are at the launch.
Where there is no fork server (Windows, macOS' default), or ``GPUCOURSE_START_METHOD=spawn`` says
so, ranks are spawned.

**How ranks stop** (:func:`stop`): SIGTERM (on failure) and a short grace period, then SIGKILL for
every rank and everything below it (:mod:`~gpucourse.runtime.process_tree`). A Ctrl-C that arrives
meanwhile cannot interrupt that: it only shortens the grace period.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.spawn as mp_spawn
import os
import signal
import sys
import time
import warnings
from multiprocessing.connection import wait as mp_wait
from typing import Callable

from .ports import loopback_interface
from .process_tree import kill_trees
from .rank_output import RankFiles
from .rank_process import rank_main

__all__ = ["Rank", "choose_start_method", "why_not_fork", "warm_parent", "start_ranks", "send_port",
           "ask_for_stacks", "stop", "wait_ready"]

#: The longest single wait of :func:`wait_ready`, in seconds. Python runs a signal's handler in the
#: main thread, between bytecodes; the OS may hand a process's SIGINT to any thread that does not
#: block it, and then a main thread asleep in ``select`` is not woken: the handler (Ctrl-C's
#: KeyboardInterrupt) would wait for the end of that select's timeout — a whole launch's.
WAKE_EVERY = 0.5


def wait_ready(objects, timeout: float | None):
    """``multiprocessing.connection.wait`` (the objects ready to read, or ``[]`` at the timeout),
    waiting at most :data:`WAKE_EVERY` s at a time, so that a Ctrl-C always takes effect at once."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        last = remaining is not None and remaining <= WAKE_EVERY
        ready = mp_wait(objects, timeout=max(0.0, remaining) if last else WAKE_EVERY)
        if ready or last:
            return ready


class Rank:
    """One started rank as the launcher sees it: the process, its two pipes, its output files."""

    def __init__(self, process, messages, port_pipe, files: RankFiles):
        self.process, self.messages, self.port_pipe, self.files = process, messages, port_pipe, files


# --- fork or spawn ------------------------------------------------------------------------------

def why_not_fork(backend: str) -> str | None:
    """Why ranks must not be forked from this process right now, or ``None`` when fork is safe."""
    import torch

    if not hasattr(os, "fork"):
        return "this platform has no fork()"
    if backend == "nccl":
        return "backend='nccl' uses CUDA in every rank, and CUDA does not work in a forked child"
    if torch.cuda.is_initialized():
        return ("CUDA is already initialised in this process, and a forked child cannot use "
                "CUDA (\"Cannot re-initialize CUDA in forked subprocess\")")
    if _cuda_driver_loaded():
        return ("the CUDA driver is loaded in this process (torch.cuda.is_available() loads and "
                "initialises it), and a forked child cannot use CUDA after that")
    return None


def _cuda_driver_loaded() -> bool:
    """Is ``libcuda`` mapped into this process? (Linux; it is loaded when the driver is initialised.)"""
    try:
        with open("/proc/self/maps") as f:
            return "libcuda.so" in f.read()
    except OSError:
        return False


#: what the fork server imports once, so that each rank it forks starts with them loaded (none of
#: them touches CUDA: a forked child could not use it)
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "gpucourse.runtime.rank_process"]


def choose_start_method(fn: Callable, backend: str = "gloo") -> str:
    """``"fork"`` where it is safe, else ``"forkserver"`` (or ``"spawn"``) — or a clear error when
    neither can work."""
    reason = why_not_fork(backend)
    if reason is None:
        return "fork"
    importable = (getattr(fn, "__module__", "__main__") != "__main__"
                  and "<" not in getattr(fn, "__qualname__", "<"))
    if importable or _has_cloudpickle():
        spawn = os.environ.get("GPUCOURSE_START_METHOD") == "spawn" or "forkserver" not in mp.get_all_start_methods()
        return "spawn" if spawn else "forkserver"
    raise RuntimeError(
        f"launch() cannot start {getattr(fn, '__qualname__', fn)!r}: {reason}, so it must start a "
        "fresh interpreter, which can only start functions it can import by name — not ones defined in "
        "a notebook cell or inside another function — unless cloudpickle is installed. Fix: "
        "pip install cloudpickle, or move the function into a .py file and import it, or restart "
        "the kernel and call launch() before anything touches CUDA."
    )


def _has_cloudpickle() -> bool:
    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        return False
    return True


def _task(fn: Callable, args: tuple, method: str, backend: str):
    """What a rank receives: ``(fn, args)`` itself when forked, cloudpickle's bytes otherwise."""
    if method == "fork":
        return fn, args
    if not _has_cloudpickle():
        return fn, args  # importable fn: multiprocessing pickles it by name
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, args))
    except Exception as e:  # noqa: BLE001
        raise TypeError(
            f"launch() starts the ranks with {method} here ({why_not_fork(backend)}), which sends fn "
            f"and args to them pickled, and they cannot be pickled: {type(e).__name__}: {e}. "
            "Pass plain data (numbers, lists, dicts, tensors) and create locks, files or "
            "connections inside fn.") from None


@contextlib.contextmanager
def _spawn_without_main():
    """Keep multiprocessing's spawn from re-running the parent's ``__main__`` in every rank.

    Spawn normally re-imports the parent's main script so that functions can be found by name.
    Here they travel by value, so that is not needed — and a script that calls ``launch()`` at top
    level without ``if __name__ == "__main__":`` would launch again from inside every rank.
    """
    original = mp_spawn.get_preparation_data

    def without_main(name):
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    mp_spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        mp_spawn.get_preparation_data = original


# --- start ---------------------------------------------------------------------------------------

_parent_warm = False


def warm_parent() -> None:
    """Import, once per process, what every forked rank would otherwise import on its own.

    Building the first ``torch.optim`` optimizer imports ``torch._dynamo`` (~1-1.5 s). A forked
    child inherits the parent's imported modules, so importing it once here saves that second in
    every rank of every later launch.
    """
    global _parent_warm
    if not _parent_warm:
        with contextlib.suppress(Exception):
            import torch._dynamo  # noqa: F401
        _parent_warm = True


def start_ranks(into: list[Rank], fn: Callable, args: tuple, nprocs: int, *, method: str,
                backend: str, init_pg: bool, timeout: float, folder: str, launch_id: str) -> None:
    """Start ``nprocs`` ranks, appending each to ``into`` as soon as it runs (so it can be stopped)."""
    if method == "fork":
        warm_parent()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)    # read when the server starts (the first time)
    task = _task(fn, tuple(args), method, backend)
    loopback = loopback_interface()
    # a fork server's child has the server's environment (from when it started): send ours
    environ = dict(os.environ) if method == "forkserver" else None
    with warnings.catch_warnings(), (_spawn_without_main() if method != "fork" and isinstance(task, bytes)
                                     else contextlib.nullcontext()):
        # Python >= 3.12 warns about fork() in a multi-threaded process (the Jupyter kernel has
        # helper threads). Children only run our code and never touch those threads.
        warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
        for rank in range(nprocs):
            messages, send = ctx.Pipe(duplex=False)
            port_recv, port_pipe = ctx.Pipe(duplex=False)
            files = RankFiles(folder, rank)
            process = ctx.Process(
                target=rank_main, name=f"gpucourse-rank{rank}", daemon=False,
                args=(task, rank, nprocs, backend, init_pg, port_recv, float(timeout), files.paths,
                      send, method == "fork", launch_id, loopback, environ))
            with _ctrl_c_deferred():   # from fork to `into`: a rank started must be a rank recorded
                process.start()
                into.append(Rank(process, messages, port_pipe, files))
            send.close()
            port_recv.close()


@contextlib.contextmanager
def _ctrl_c_deferred():
    """A Ctrl-C (SIGINT) during the block takes effect at its end.

    Between a rank's fork and the launcher recording it, a KeyboardInterrupt would leave that rank
    unknown to :func:`stop`: it waited for the store's port until its timeout, and at exit
    ``multiprocessing`` joined it (a script hung for the whole timeout after Ctrl-C). Only in the
    main thread with a Python-level handler (elsewhere there is nothing to defer).
    """
    import threading

    old = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(old):
        yield
        return
    pending: list = []

    def later(signum, frame):
        pending.append((signum, frame))

    signal.signal(signal.SIGINT, later)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if pending:
            old(*pending[0])      # the handler that was there decides (default: KeyboardInterrupt)


def send_port(ranks: list[Rank], port: int) -> None:
    """Tell every rank where the store is; they wait for this before anything else."""
    for r in ranks:
        r.port_pipe.send(port)
        r.port_pipe.close()


# --- stop ----------------------------------------------------------------------------------------

def ask_for_stacks(ranks: list[Rank], which: list[int]) -> None:
    """SIGUSR1 to hung ranks: each writes its Python stack (faulthandler) to its ``.stack`` file."""
    if not hasattr(signal, "SIGUSR1"):
        return
    for r in which:
        with contextlib.suppress(ProcessLookupError):
            os.kill(ranks[r].process.pid, signal.SIGUSR1)
    time.sleep(0.3)


def stop(ranks: list[Rank], launch_id: str, *, clean: bool) -> bool:
    """Stop every rank and everything it started; returns whether a Ctrl-C arrived meanwhile.

    ``clean``: the ranks are finishing on their own (give them 5 s to exit). Otherwise: SIGTERM,
    0.5 s of grace, then SIGKILL. A Ctrl-C during this is absorbed and only ends the grace
    period at once — a second Ctrl-C in a notebook must never leave ranks running.
    """
    grace, interrupted = (5.0 if clean else 0.5), False
    while True:
        try:
            _stop(ranks, launch_id, grace, None if clean else signal.SIGTERM)
            return interrupted
        except KeyboardInterrupt:
            interrupted, grace = True, 0.0


def _stop(ranks: list[Rank], launch_id: str, grace: float, first_signal) -> None:
    procs = [r.process for r in ranks if r.process.pid is not None]
    running = [p for p in procs if not _exited(p)]
    if first_signal is not None and grace > 0:
        for p in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, first_signal)
    deadline = time.monotonic() + grace
    while running and time.monotonic() < deadline:
        mp_wait([p.sentinel for p in running], timeout=deadline - time.monotonic())
        running = [p for p in running if not _exited(p)]
    # not joined yet: an exited rank stays a zombie, so its pid cannot be reused by another process
    kill_trees([p.pid for p in procs], launch_id if sys.platform.startswith("linux") else None)
    for p in procs:
        p.join(5)


def _exited(process) -> bool:
    """Has it exited? (Unlike ``is_alive()``, this does not reap it: its pid stays ours.)"""
    return bool(mp_wait([process.sentinel], timeout=0))
