"""Start ``fn(rank, world_size, *args)`` in several processes — from a script *or* a notebook cell.

This is what ``torch.multiprocessing.spawn`` and ``torchrun`` do for a training script, made safe
for a Jupyter kernel. :func:`launch` is the whole algorithm:

1) start ``nprocs`` rank processes (``fork``, so a function defined in a notebook cell works; a
   fresh ``spawn`` with the function sent by value when CUDA may be in use);
2) host the key-value store they meet at, on a loopback port the OS picks and holds, and tell
   them the port; every rank sets the torchrun variables, joins a fresh process group, runs ``fn``
   and leaves the group;
3) wait for every rank with one deadline: collect the return values in rank order, or the first
   failure, or the ranks still running when time is up;
4) stop every rank — and anything a rank started — whatever happened (success, an exception, a
   hang, Ctrl-C), so ``launch`` can be called again in the same kernel;
5) print each rank's output grouped as ``[rank r] ...`` and return the results, or raise
   :class:`WorkerError` (naming the rank, with its traceback) or ``TimeoutError`` (naming the ranks
   and where each one was stuck).

The process plumbing lives in sibling modules: ``processes`` (fork or spawn, start, stop),
``rank_process`` (what runs inside a rank), ``process_tree`` (finding every descendant),
``ports`` (the loopback store), ``rank_output`` (captured output).

Why not ``mp.spawn`` in a notebook? ``spawn`` starts a fresh interpreter that re-imports
``__main__`` to find ``fn``; a notebook's ``__main__`` is the kernel, not a file, so a function
defined in a cell cannot be found (``AttributeError: Can't get attribute 'fn' on <module '__main__'>``).
``fork`` copies the running kernel instead, cell-defined functions included — accelerate's
``notebook_launcher`` does the same.
"""

from __future__ import annotations

import pickle
import secrets
import tempfile
import time
from typing import Any, Callable, Sequence

from .ports import _ephemeral_range, free_port, host_store  # noqa: F401 - free_port is public here
from .process_tree import launcher_subreaper
from .processes import Rank, ask_for_stacks, choose_start_method, send_port, start_ranks, stop
from .processes import wait_ready as _wait_for
from .rank_output import (abort_reason, blocked_report, exception_line, print_grouped, rank_died, read,
                          tidy_stack)
from .validate import check_choice, check_int, check_positive

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
        WorkerError: a rank raised (or died); ``.rank`` names it — a rank that died (gloo aborts
            one whose recv is smaller than the message; its first line says so) before its peers
            that lost their connection, and where several raised, the lowest that raised an error
            of its own — and the message holds its traceback (or its stderr).
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
        ``OMP_NUM_THREADS=1``. The store and gloo listen on loopback only: ranks of one launch
        talk within this machine, never over the network.
    """
    _check_arguments(fn, nprocs, args, backend, timeout, init_process_group)
    method = choose_start_method(fn, backend)
    launch_id = secrets.token_hex(8)   # marks everything the ranks start, to find it again
    ranks: list[Rank] = []
    failure = limits = None
    with tempfile.TemporaryDirectory(prefix="gpucourse-launch-") as folder, launcher_subreaper():
        try:
            # 1) start the ranks; each one waits for the store's port before doing anything
            start_ranks(ranks, fn, args, nprocs, method=method, backend=backend,
                        init_pg=init_process_group, timeout=timeout, folder=folder, launch_id=launch_id)
            # 2) host the store they meet at (127.0.0.1 only), created after the last fork so no
            #    rank inherits its sockets; it also serves the ranks' closing barrier
            store = host_store(timeout)
            send_port(ranks, store.port)
            # 3) wait for every rank, one deadline for the whole run
            results, failure = _wait_for_ranks(ranks, timeout)
            if failure is not None:
                # what ranks print while being stopped (peers complaining that a connection closed)
                # is noise: keep only what was written before the decision to stop them
                limits = [r.files.sizes() for r in ranks]
                if failure[0] == "timeout":   # ask each hung rank where it is (faulthandler)
                    ask_for_stacks(ranks, failure[1] + failure[2] + failure[3])
        except BaseException:  # KeyboardInterrupt from the notebook's stop button, among others
            _stop_surely(ranks, launch_id, clean=False)   # 4) ... every rank, and all it started
            raise
        interrupted = _stop_surely(ranks, launch_id, clean=failure is None)   # 4)
        del store
        outs = [read(r.files.out, limits and limits[i][0]) for i, r in enumerate(ranks)]
        errs = [read(r.files.err, limits and limits[i][1]) for i, r in enumerate(ranks)]
        stacks = [read(r.files.stack) for r in ranks]
    # 5) report
    print_grouped(outs, errs)
    if interrupted:
        raise KeyboardInterrupt
    if failure is None:
        return results
    if failure[0] == "timeout":
        raise _timeout_error(failure, stacks, nprocs, timeout)
    raise _worker_error(failure, errs)


def _stop_surely(ranks: list[Rank], launch_id: str, clean: bool) -> bool:
    """:func:`stop`, again if a second Ctrl-C lands as it begins. Python raises a pending signal at a
    function's start, before stop's own guard; the second call absorbs what comes later. Returns
    whether a Ctrl-C came."""
    try:
        return stop(ranks, launch_id, clean=clean)
    except KeyboardInterrupt:
        stop(ranks, launch_id, clean=False)
        return True


def _wait_for_ranks(ranks: list[Rank], timeout: float):
    """Wait for every rank. Returns ``(results, None)`` or ``(partial results, failure)``.

    ``failure`` is ``("timeout", ranks still in fn, ranks waiting in the closing barrier, ranks
    still joining the process group)`` or
    ``("error", rank, exception type name | None, traceback, exitcode)`` for the failed rank: the
    lowest that raised an error of its own (:func:`_lowest_failure`), or one that died.
    """
    n = len(ranks)
    results: list[Any] = [None] * n
    joined = [False] * n    # set-up done (process group joined), fn started
    returned = [False] * n  # fn returned; the rank may still be in the closing barrier
    reported = [False] * n  # final message received
    deadline = time.monotonic() + timeout
    by_pipe = {r.messages: i for i, r in enumerate(ranks)}
    by_sentinel = {r.process.sentinel: i for i, r in enumerate(ranks)}
    while not all(reported):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            late = [i for i in range(n) if not reported[i]]
            return results, ("timeout", [i for i in late if joined[i] and not returned[i]],
                             [i for i in late if returned[i]], [i for i in late if not joined[i]])
        waitables = [c for c, i in by_pipe.items() if not reported[i]]
        waitables += [s for s, i in by_sentinel.items() if not reported[i]]
        for obj in _wait_for(waitables, timeout=remaining):
            if obj in by_pipe:
                i = by_pipe[obj]
                try:
                    msg = obj.recv()
                except EOFError:  # the pipe closed without a final message: the process died
                    ranks[i].process.join(1)
                    return results, ("error", i, None, "", ranks[i].process.exitcode)
                if msg[0] in ("joined", "returned"):
                    (joined if msg[0] == "joined" else returned)[i] = True
                    continue
                reported[i] = True
                if msg[0] != "ok":
                    return results, _lowest_failure(ranks, reported, i, msg, returned=returned)
                results[i] = pickle.loads(msg[1])
            elif not reported[by_sentinel[obj]] and not ranks[by_sentinel[obj]].messages.poll(0):
                i = by_sentinel[obj]  # exited, and nothing is left to read: it died
                ranks[i].process.join(1)
                return results, ("error", i, None, "", ranks[i].process.exitcode)
    return results, None


#: seconds the launcher waits, after a rank raised, for the others' reports before naming one
FAILURE_SETTLE = 2.0


def _lowest_failure(ranks: list[Rank], reported: list[bool], first: int, msg: tuple,
                    settle: float = FAILURE_SETTLE, returned: list[bool] | None = None) -> tuple:
    """The failure to report once rank ``first`` raised (``msg``), among the reports and deaths
    that arrive within ``settle`` seconds: a rank that died (one that aborted first, then the
    lowest), else the lowest rank that raised an error of its own, else the lowest that raised.

    Ranks often fail together (each raises the same error on its own shard), and which of them
    reports first is a race: naming that one made the same run say "rank 0 raised" once and "rank 1
    raised" the next. An error that only says a peer's connection went away is the effect of
    another rank's failure, so a rank that raised one is named only when no other rank raised or
    died. A rank that gloo aborts (``terminate called ...``: a send and its recv disagree on the
    size) closes its connections at once but dies later — it writes a stack dump first, slowly on
    a busy machine — so its peer's "Connection reset by peer" often arrives first: the aborting
    rank is named all the same (its stderr says that it is aborting).

    A rank whose ``fn`` has returned (``returned``) is not waited for: it can no longer raise, and
    it waits in the closing barrier for the rank that failed. When every other rank has returned,
    the failure is reported at once (a wrong answer that raised on one rank took 2 s to show)."""
    failures = {first: (msg[1], msg[2])}
    died: dict[int, int | None] = {}
    pending = {r.messages: j for j, r in enumerate(ranks) if not reported[j] and not (returned and returned[j])}
    deadline = time.monotonic() + settle
    while pending and time.monotonic() < deadline:
        for conn in _wait_for(list(pending), timeout=max(0.0, deadline - time.monotonic())):
            j = pending.pop(conn)
            try:
                reply = conn.recv()
            except EOFError:                     # it died: the pipe closes as the process exits
                ranks[j].process.join(1)
                died[j] = ranks[j].process.exitcode
                continue
            if reply[0] == "joined":
                pending[conn] = j
                continue
            if reply[0] == "returned":            # in the closing barrier now: nothing more to hear
                continue
            reported[j] = True
            if reply[0] != "ok":
                failures[j] = (reply[1], reply[2])
    for j in pending.values():                   # aborting but not dead yet: wait for it, once more
        if _aborting(ranks[j]):
            ranks[j].process.join(settle)
            died[j] = ranks[j].process.exitcode
    dead = [j for j, code in died.items() if code != 0]
    if dead:                                     # a death is the cause, its peers' errors the effect
        rank = min(dead, key=lambda j: (not _aborting(ranks[j]), j))
        return ("error", rank, None, "", died[rank])
    own = [j for j, (_, tb) in failures.items() if not any(w in (tb or "") for w in _PEER_GONE)]
    rank = min(own or failures)
    return ("error", rank, *failures[rank], None)


#: what a rank's collective raises when a peer's connection went away (gloo, NCCL's TCP store)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe",
              "Socket Timeout", "recvValue failed")

#: what a rank's stderr shows when C++ aborts it (an uncaught C++ exception, gloo's checks)
_ABORTING = ("terminate called", "Fatal Python error: Aborted")


def _aborting(rank: Rank) -> bool:
    """Whether the rank's stderr says that it is aborting (or aborted)."""
    return any(w in read(rank.files.err) for w in _ABORTING)


# --- checks and reports ----------------------------------------------------------------------------

def _check_arguments(fn, nprocs, args, backend, timeout, init_process_group) -> None:
    import torch
    import torch.distributed as dist

    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r} of type {type(fn).__name__}")
    check_int("nprocs", nprocs, 1)
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of extra arguments for fn, got {type(args).__name__}"
                        f" {args!r}; for one argument write args=(x,)")
    check_choice("backend", backend, _BACKENDS)
    check_positive("timeout", timeout)
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


def _timeout_error(failure, stacks: list[str], nprocs: int, timeout: float) -> TimeoutError:
    _, in_fn, in_barrier, joining = failure
    where = "".join(f"\n--- rank {r} was here when stopped ---\n{tidy_stack(stacks[r])}" for r in in_fn)
    states = [f"rank(s) {in_fn} of {nprocs} did not finish fn within {timeout:g} s"] if in_fn else []
    if in_barrier:
        states.append(f"rank(s) {in_barrier} had returned from fn and were waiting for the others")
    if joining:
        states.append(f"rank(s) {joining} were still joining the process group (a machine "
                      "too busy, or a firewall blocking loopback ports)")
    positions, why = blocked_report({r: tidy_stack(stacks[r]) for r in in_fn if stacks[r].strip()},
                                    list(range(nprocs)))
    blocked = positions + (f": {why}" if why else "")
    error = TimeoutError(
        f"launch(): {'; '.join(states)}. Usual causes: a collective that only some ranks call, "
        "a wrong world_size, a rank waiting for a message nobody sends, an endless loop. All "
        f"processes were stopped." + (f" Blocked: {blocked}." if blocked else "") + where)
    error.blocked = blocked          # where each rank waited, one line (a grader stops the check here)
    return error


def _worker_error(failure, errs: list[str]) -> WorkerError:
    _, rank, exc_type, tb, exitcode = failure
    if exc_type is None:
        reason = abort_reason(errs[rank])
        first = rank_died(rank, exitcode, reason) + ("" if reason else " before reporting a result")
        detail = tidy_stack(errs[rank]) or "(it printed nothing to stderr)"
        return WorkerError(rank, f"{first}\n--- stderr of rank {rank} ---\n{detail}", exitcode=exitcode)
    last = exception_line(tb) or exc_type
    return WorkerError(rank, f"rank {rank} raised {last}\n--- traceback from rank {rank} ---\n{tb}",
                       exc_type=exc_type, remote_traceback=tb, exitcode=exitcode)


