"""Start ``fn(rank, world_size, *args)`` in several processes — from a script *or* a notebook cell.

This is what ``torch.multiprocessing.spawn`` and ``torchrun`` do for a training script, made safe
for a Jupyter kernel:

1) host the key-value store the ranks meet at (on a loopback port the OS picks, held from the
   start, so no other process can take it) and start ``nprocs`` children (``fork`` where that is
   safe, so a function defined in a notebook cell works; ``spawn`` otherwise);
2) in every child: set ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` like
   torchrun does, join a fresh process group, run ``fn``, leave the group;
3) in the parent: wait for every rank with a deadline, collect return values in rank order, print
   each rank's output grouped as ``[rank r] ...``, and turn a failure into an exception that names
   the rank and carries its traceback.

Whatever happens (success, an exception, a hang, Ctrl-C) every child — and anything a child started —
is gone when :func:`launch` returns, so it can be called again in the same kernel.

Why not ``mp.spawn`` in a notebook? ``spawn`` starts a fresh interpreter that re-imports
``__main__`` to find ``fn``; a notebook's ``__main__`` is the kernel, not a file, so a function
defined in a cell cannot be found (``AttributeError: Can't get attribute 'fn' on <module '__main__'>``).
``fork`` copies the running kernel instead, cell-defined functions included — accelerate's
``notebook_launcher`` does the same.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import io
import multiprocessing as mp
import os
import pickle
import random
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from multiprocessing.connection import wait as _wait_for
from typing import Any, Callable, Sequence

__all__ = ["launch", "WorkerError", "free_port"]

_BACKENDS = ("gloo", "nccl", "mpi")


class WorkerError(RuntimeError):
    """A rank started by :func:`launch` failed.

    Attributes:
        rank: the global rank that failed first.
        exc_type: name of the exception raised in that rank (``"ValueError"``), or ``None`` when the
            process died without raising (killed by a signal, ``os._exit``).
        remote_traceback: the traceback text printed in that rank (empty when it died silently).
        exitcode: the process exit code (negative: killed by that signal number), if known.

    Example::

        >>> def picky(rank, world_size):
        ...     if rank == 1:
        ...         raise ValueError("rank 1 refuses")
        >>> try:
        ...     launch(picky, 2, init_process_group=False)
        ... except WorkerError as e:
        ...     print(e.rank, e.exc_type, str(e).splitlines()[0])
        1 ValueError rank 1 raised ValueError: rank 1 refuses
    """

    def __init__(self, rank: int, message: str, *, exc_type: str | None = None,
                 remote_traceback: str = "", exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode

    def __reduce__(self):  # keep the attributes when pickled (e.g. by pytest-xdist)
        return (_rebuild_worker_error, (self.rank, str(self), self.exc_type,
                                        self.remote_traceback, self.exitcode))


def _rebuild_worker_error(rank, message, exc_type, remote_traceback, exitcode):
    return WorkerError(rank, message, exc_type=exc_type, remote_traceback=remote_traceback,
                       exitcode=exitcode)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now, for a store some process will bind later.

    The port is picked at random *outside* the kernel's ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``, usually 32768-60999). Asking the OS for "port 0"
    would return a port from that range, and between this call and the moment rank 0 binds it, any
    process on the machine (a gloo connection, another job's store) may be handed the same port
    by the OS — ``EADDRINUSE``. Ports below the range are never handed out that way. If the range
    leaves no room, it falls back to asking the OS.

    Example::

        >>> port = free_port()
        >>> 1024 <= port <= 65535
        True
    """
    lo, hi = _ephemeral_range()
    pool = [(a, b) for a, b in ((20000, min(lo, 65536) - 1), (max(hi, 20000) + 1, 65535)) if b > a + 100]
    rng = random.SystemRandom()
    for _ in range(64 if pool else 0):
        a, b = rng.choice(pool)
        port = rng.randint(a, b)
        if 29400 <= port <= 29600:  # torchrun's default 29500 and neighbours: leave them to others
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    """The range the kernel takes ports from for ``bind(port 0)`` and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 65535  # the IANA range, which macOS and Windows use


# --------------------------------------------------------------------------------------------
# The child side
# --------------------------------------------------------------------------------------------

def _linux_child_setup(name: str) -> None:
    """Linux only: name this process and have it die with its parent.

    1) ``PR_SET_NAME``: the process shows as ``name`` (at most 15 bytes) in ``ps -e``, ``top`` and
       ``pgrep gpucourse-rank``, instead of as one more copy of the kernel's ``python``;
    2) ``PR_SET_PDEATHSIG``: the kernel kills this child if the parent (the notebook kernel) dies.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:  # pragma: no cover - exotic libc
        pass


def _redirect_output(stdout_path: str, stderr_path: str) -> None:
    """Point fd 1/2 *and* sys.stdout/sys.stderr at this rank's files.

    Both levels matter: ``print`` goes through ``sys.stdout`` (in a notebook that is an ipykernel
    stream whose sender thread does not exist in a forked child), while C++ warnings from
    torch/gloo write straight to file descriptor 2.
    """
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)
    sys.stdin = open(os.devnull)


def _child_main(fn, rank, world_size, args, backend, init_pg, port_conn, timeout, paths, conn,
                forked):
    """Body of every rank.

    Sends ``("returned",)`` when ``fn`` has returned, then ``("ok", pickled result)`` or
    ``("error", exception type name, traceback text)`` on ``conn``.
    """
    os.setpgid(0, 0)  # own process group: the parent can kill us *and* whatever we start
    _linux_child_setup(f"gpucourse-rank{rank}")
    stdout_path, stderr_path, stack_path = paths
    _redirect_output(stdout_path, stderr_path)
    faulthandler.enable(sys.stderr)  # a segfault still leaves a Python stack in the rank's output
    if hasattr(signal, "SIGUSR1"):  # the parent sends SIGUSR1 before killing a hung rank
        stack_file = open(stack_path, "w")  # noqa: SIM115 - must stay open until the process ends
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)

    # the parent creates the store only once every rank has been started (see launch)
    if not port_conn.poll(timeout):
        os._exit(3)
    port = port_conn.recv()
    port_conn.close()

    import torch

    # GNU OpenMP (torch's CPU thread pool) cannot be used from a forked child once the parent has
    # run a parallel region: a child asking for >1 thread may wait forever. One intra-op thread
    # per rank is also what torchrun sets (OMP_NUM_THREADS=1) — the ranks are the parallelism.
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
        OMP_NUM_THREADS="1",
        # as under torchrun: the store at MASTER_ADDR:MASTER_PORT is hosted by the launcher (the
        # parent), so env:// makes every rank a client of it, rank 0 included
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    # init_process_group returns only once every rank has joined (torch's own store-based barrier).
    # Without it, a rank that joins and leaves at once closes connections a slower peer is still
    # setting up ("Gloo connectFullMesh failed ... Connection closed by peer").
    os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
    import torch.distributed as dist

    message: tuple
    client = None
    try:
        if init_pg:
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            # every rank is a client of the store the parent hosts (what torchrun's agent does)
            client = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout))
            store = dist.PrefixStore("gpucourse/pg", client)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout))
        conn.send(("joined",))
        result = fn(rank, world_size, *args)
        conn.send(("returned",))
        if client is None:  # one connection per rank: each one costs a reverse DNS lookup in torch
            client = dist.TCPStore("127.0.0.1", port, is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        _closing_barrier(client, rank, world_size)
        try:
            message = ("ok", pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # noqa: BLE001
            message = ("error", type(e).__name__,
                       f"rank {rank} finished, but its return value could not be sent back to the "
                       f"parent ({type(e).__name__}: {e}). Return plain data: numbers, lists, dicts, "
                       "tensors.\n")
    except SystemExit as e:
        if e.code in (0, None):
            message = ("ok", pickle.dumps(None))
        else:
            message = ("error", "SystemExit", f"SystemExit({e.code!r}) raised in rank {rank}\n"
                       + traceback.format_exc())
    except BaseException as e:  # noqa: BLE001 - everything must reach the parent
        message = ("error", type(e).__name__, traceback.format_exc())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    conn.send(message)
    conn.close()
    if init_pg and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    if forked:  # skip atexit handlers and finalizers inherited from the parent (e.g. the kernel's)
        os._exit(0)


def _closing_barrier(store, rank: int, world_size: int) -> None:
    """Wait until every rank has returned from ``fn`` before anyone tears down its sockets.

    Without it, a rank that finishes a collective early could close connections a peer is still
    reading from ("Connection closed by peer"), and rank 0 — which hosts the store when ``fn``
    creates its group from its own ``tcp://`` address — could leave while a peer still needs it.
    It goes through the parent's store, not ``dist.barrier()``, so it can never pair up with a
    barrier that ``fn`` called on only some ranks, and it works when ``fn`` manages (or already
    destroyed) its own group. Rank 0 leaves last.
    """
    store.set(f"gpucourse/returned/{rank}", "1")
    store.wait([f"gpucourse/returned/{r}" for r in range(world_size)])
    if rank != 0:
        store.set(f"gpucourse/left/{rank}", "1")
    else:
        store.wait([f"gpucourse/left/{r}" for r in range(1, world_size)])


# --------------------------------------------------------------------------------------------
# The parent side
# --------------------------------------------------------------------------------------------

_parent_warm = False


def _warm_parent() -> None:
    """Import, once per process, what every rank would otherwise import on its own.

    Building the first ``torch.optim`` optimizer imports ``torch._dynamo`` (~1-1.5 s). A forked
    child inherits the parent's imported modules, so importing it once here saves that second in
    every rank of every later launch.
    """
    global _parent_warm
    if not _parent_warm:
        with contextlib.suppress(Exception):
            import torch._dynamo  # noqa: F401
        _parent_warm = True


def _choose_start_method(fn: Callable) -> str:
    """``fork`` where it is safe, else ``spawn`` — or a clear error when neither can work."""
    import torch

    importable = (getattr(fn, "__module__", "__main__") != "__main__"
                  and "<" not in getattr(fn, "__qualname__", "<"))
    fork_ok = hasattr(os, "fork")
    reason = ""
    if not fork_ok:
        reason = "this platform has no fork()"
    elif torch.cuda.is_initialized():
        fork_ok = False
        reason = ("CUDA is already initialised in this process, and a forked child cannot use "
                  "CUDA (\"Cannot re-initialize CUDA in forked subprocess\")")
    if fork_ok:
        return "fork"
    if importable:
        return "spawn"
    raise RuntimeError(
        f"launch() cannot start {getattr(fn, '__qualname__', fn)!r}: {reason}, so it must use "
        "'spawn', and spawn can only start functions it can import by name — not ones defined in "
        "a notebook cell or inside another function. Fix: move the function into a .py file and "
        "import it, or restart the kernel and call launch() before anything touches CUDA."
    )


def _signal_name(exitcode: int | None) -> str:
    if exitcode is None or exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"signal {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"signal {-exitcode}"


def _kill(procs: Sequence[mp.process.BaseProcess], sig_first: int | None = None,
          grace: float = 0.0) -> None:
    """Kill every child's whole process group (the child and anything it started)."""
    if sig_first is not None:
        for p in procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig_first)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            time.sleep(0.02)
    for p in procs:
        if p.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # the group outlives a leader that already exited
    for p in procs:
        p.join(5)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read(path: str, limit: int | None = None) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read() if limit is None else f.read(limit)
    except FileNotFoundError:
        return ""
    return data.decode("utf-8", errors="replace")


def _print_grouped(outs: list[str], errs: list[str]) -> None:
    """Each rank's captured stdout (then stderr), lines prefixed ``[rank r]``, in rank order."""
    for rank, text in enumerate(outs):
        for line in text.splitlines():
            print(f"[rank {rank}] {line}")
    sys.stdout.flush()
    for rank, text in enumerate(errs):
        for line in text.splitlines():
            print(f"[rank {rank}] {line}", file=sys.stderr)
    sys.stderr.flush()


def _validate(fn, nprocs, args, backend, timeout):
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r} of type {type(fn).__name__}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int):
        raise TypeError(f"nprocs must be an int, got {nprocs!r} of type {type(nprocs).__name__}")
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of extra arguments for fn, got {type(args).__name__}"
                        f" {args!r}; for one argument write args=(x,)")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if not timeout > 0:  # also rejects NaN
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")


def launch(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *, backend: str = "gloo",
           init_process_group: bool = True, timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``nprocs`` processes; return the results in rank order.

    Args:
        fn: the per-rank function. May be defined in a notebook cell.
        nprocs: number of processes (the *world size*; one per GPU on a GPU machine).
        args: extra positional arguments passed to every rank.
        backend: ``"gloo"`` (CPU, works everywhere), ``"nccl"`` (CUDA GPUs) or ``"mpi"``.
        init_process_group: join a fresh default process group on a loopback port before
            ``fn`` runs, and leave it afterwards. With ``False``, the torchrun variables
            (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) are still set,
            so ``fn`` can call ``dist.init_process_group(backend)`` itself (``env://``). As under
            torchrun, the store at ``MASTER_PORT`` is hosted by the launcher and
            ``TORCHELASTIC_USE_AGENT_STORE=True`` tells ``env://`` to connect to it as a client;
            ``TORCH_DIST_INIT_BARRIER=1`` (unless already set) makes ``init_process_group``
            return only once every rank has joined, so a rank may leave the group right away.
        timeout: seconds for the whole run; also the process group's collective timeout.

    Returns:
        ``[fn(0, ...), fn(1, ...), ...]`` — return values must be picklable.

    Raises:
        WorkerError: a rank raised (or died); ``.rank`` names it, the message holds its traceback.
        TimeoutError: not all ranks finished within ``timeout``; names the ranks still running
            and shows where each one was stuck.

    Each rank's printed output is shown after the run, grouped and in rank order::

        >>> import torch, torch.distributed as dist
        >>> def total(rank, world_size):
        ...     t = torch.tensor([rank + 1.0])
        ...     dist.all_reduce(t)                  # sum over the group: 1 + 2
        ...     print(f"I am rank {rank} of {world_size}")
        ...     return t.item()
        >>> launch(total, 2)
        [rank 0] I am rank 0 of 2
        [rank 1] I am rank 1 of 2
        [3.0, 3.0]

    .. warning::
        Each rank runs with ``torch.set_num_threads(1)``. Do not raise it inside ``fn`` when the
        children were forked: GNU OpenMP's thread pool does not survive ``fork`` and the rank can
        hang. Parallelism here comes from the ranks, exactly as with torchrun's
        ``OMP_NUM_THREADS=1``.
    """
    _validate(fn, nprocs, args, backend, timeout)
    import torch
    import torch.distributed as dist

    if init_process_group:
        if backend == "nccl" and torch.cuda.device_count() < nprocs:
            raise ValueError(f"backend='nccl' needs one CUDA device per process: nprocs={nprocs} but "
                             f"{torch.cuda.device_count()} CUDA device(s) are visible; use "
                             "backend='gloo' on a CPU machine")
        if not dist.is_backend_available(backend):
            raise ValueError(f"backend {backend!r} is not available in this PyTorch build "
                             f"({torch.__version__}); use backend='gloo'")
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("a default process group is already initialised in this process; "
                           "children would inherit it. Call torch.distributed.destroy_process_group() "
                           "first, then launch() again")

    method = _choose_start_method(fn)
    if method == "fork":
        _warm_parent()
    ctx = mp.get_context(method)
    procs: list[mp.process.BaseProcess] = []
    conns = []
    port_conns = []
    control = None
    with tempfile.TemporaryDirectory(prefix="gpucourse-launch-") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.out") for r in range(nprocs)]
        errs = [os.path.join(tmp, f"rank{r}.err") for r in range(nprocs)]
        stacks = [os.path.join(tmp, f"rank{r}.stack") for r in range(nprocs)]
        try:
            with warnings.catch_warnings():
                # Python >= 3.12 warns about fork() in a multi-threaded process (the Jupyter kernel
                # has helper threads). Children only run our code and never touch those threads.
                warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
                for rank in range(nprocs):
                    recv, send = ctx.Pipe(duplex=False)
                    port_recv, port_send = ctx.Pipe(duplex=False)
                    p = ctx.Process(
                        target=_child_main, name=f"gpucourse-rank{rank}", daemon=False,
                        args=(fn, rank, nprocs, tuple(args), backend, init_process_group,
                              port_recv, float(timeout), (outs[rank], errs[rank], stacks[rank]),
                              send, method == "fork"),
                    )
                    p.start()
                    send.close()
                    port_recv.close()
                    procs.append(p)
                    conns.append(recv)
                    port_conns.append(port_send)
            # The parent hosts the store the ranks meet at, as torchrun's agent does. Binding port
            # 0 lets the OS choose a free port and keeps it bound: a port chosen here but bound
            # later by rank 0 can be taken by another process in between (EADDRINUSE). It also
            # serves the closing barrier (see _closing_barrier). It is created after the last
            # fork, so no child inherits the server's sockets or its event loop's state.
            control = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout))
            for c in port_conns:
                c.send(control.port)
                c.close()
            results, failure = _collect(procs, conns, timeout)
        except BaseException:  # KeyboardInterrupt from the notebook's stop button, among others
            _kill(procs, signal.SIGTERM, grace=0.5)
            raise
        limits: list[int | None] = [None] * (2 * nprocs)  # byte limits: stdout files, then stderr
        if failure is not None:
            # what ranks print while being stopped (peers complaining that a connection closed)
            # is noise: keep only the output written before the decision to stop them
            limits = [_size(p) for p in outs + errs]
            hung = failure[0] == "timeout"
            if hung:  # ask each hung rank for its Python stack (faulthandler), then kill
                for r in failure[1] + failure[2] + failure[3]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(procs[r].pid, signal.SIGUSR1)
                time.sleep(0.3)
            _kill(procs, signal.SIGTERM, grace=0.5)
        else:
            for p in procs:  # clean exits: give them a moment, then make sure
                p.join(5)
            _kill(procs)
        out_text = [_read(p, limit) for p, limit in zip(outs, limits[:nprocs])]
        err_text = [_read(p, limit) for p, limit in zip(errs, limits[nprocs:])]
        stack_text = [_read(p) for p in stacks]
    del control
    _print_grouped(out_text, err_text)
    if failure is None:
        return results
    if failure[0] == "timeout":
        _, in_fn, in_barrier, joining = failure
        where = "".join(f"\n--- rank {r} was here when stopped ---\n{_tidy_stack(stack_text[r])}"
                        for r in in_fn)
        states = [f"rank(s) {in_fn} of {nprocs} did not finish fn within {timeout:g} s"] if in_fn else []
        if in_barrier:
            states.append(f"rank(s) {in_barrier} had returned from fn and were waiting for the others")
        if joining:
            states.append(f"rank(s) {joining} were still joining the process group (a machine "
                          "too busy, or a firewall blocking loopback ports)")
        raise TimeoutError(
            f"launch(): {'; '.join(states)}. Usual causes: a collective that only some ranks call, "
            "a wrong world_size, a rank waiting for a message nobody sends, an endless loop. All "
            f"processes were stopped.{where}"
        )
    _, rank, exc_type, tb, exitcode = failure
    if exc_type is None:
        first = f"rank {rank} died with {_signal_name(exitcode)} before reporting a result"
        detail = _tidy_stack(err_text[rank]) or "(it printed nothing to stderr)"
        raise WorkerError(rank, f"{first}\n--- stderr of rank {rank} ---\n{detail}",
                          exitcode=exitcode)
    last = tb.strip().splitlines()[-1] if tb.strip() else exc_type
    raise WorkerError(rank, f"rank {rank} raised {last}\n--- traceback from rank {rank} ---\n{tb}",
                      exc_type=exc_type, remote_traceback=tb, exitcode=exitcode)


def _tidy_stack(text: str) -> str:
    """Keep the user's frames of a faulthandler dump (most recent call first).

    Everything from the launcher's own frame down is machinery (multiprocessing's bootstrap and,
    for a forked child, the parent's frames it inherited), so it is dropped.
    """
    keep, skipping = [], False
    for line in text.splitlines():
        if line.startswith("Extension modules:"):
            continue
        is_frame = line.lstrip().startswith("File ")
        if is_frame and os.path.join("gpucourse", "runtime", "launcher.py") in line:
            skipping = True
        if not is_frame:
            skipping = False
        if not skipping:
            keep.append(line)
    return "\n".join(keep).strip()


def _collect(procs, conns, timeout):
    """Wait for every rank. Returns ``(results, None)`` or ``(partial results, failure)``.

    ``failure`` is ``("timeout", ranks still in fn, ranks waiting in the closing barrier, ranks
    still joining the process group)`` or
    ``("error", rank, exception type name | None, traceback, exitcode)`` for the first failed rank.
    """
    n = len(procs)
    results: list[Any] = [None] * n
    joined = [False] * n    # set-up done (process group joined), fn started
    returned = [False] * n  # fn returned; the rank may still be in the closing barrier
    reported = [False] * n  # final message received
    deadline = time.monotonic() + timeout
    by_conn = {c: r for r, c in enumerate(conns)}
    by_sentinel = {p.sentinel: r for r, p in enumerate(procs)}
    while not all(reported):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            late = [r for r in range(n) if not reported[r]]
            return results, ("timeout", [r for r in late if joined[r] and not returned[r]],
                             [r for r in late if returned[r]], [r for r in late if not joined[r]])
        waitables = [c for c, r in by_conn.items() if not reported[r]]
        waitables += [s for s, r in by_sentinel.items() if not reported[r]]
        for obj in _wait_for(waitables, timeout=remaining):
            if obj in by_conn:
                r = by_conn[obj]
                try:
                    msg = obj.recv()
                except EOFError:  # the pipe closed without a final message: the process died
                    procs[r].join(1)
                    return results, ("error", r, None, "", procs[r].exitcode)
                if msg[0] in ("joined", "returned"):
                    (joined if msg[0] == "joined" else returned)[r] = True
                    continue
                reported[r] = True
                if msg[0] != "ok":
                    return results, ("error", r, msg[1], msg[2], None)
                results[r] = pickle.loads(msg[1])
            elif not reported[by_sentinel[obj]] and not conns[by_sentinel[obj]].poll(0):
                r = by_sentinel[obj]  # exited, and nothing is left to read: it died
                procs[r].join(1)
                return results, ("error", r, None, "", procs[r].exitcode)
    return results, None
