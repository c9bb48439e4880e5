"""Live ranks: ``n`` processes that stay in one process group between notebook cells.

:func:`~gpucourse.launch` starts ranks, runs one function and ends them — right for scripts, tests
and most cells. Live ranks stay: a learner runs a cell on every rank, looks at rank 1's tensor
after an all-reduce, changes a line and runs it again, or watches ``dist.barrier()`` block::

    gc.start_ranks(2)            # two processes that have joined a gloo group; registers %%ranks

    %%ranks                      # this cell runs on every rank; rank, world_size, dist, torch are bound
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    t                            # [rank 0] tensor([3.])  /  [rank 1] tensor([3.])

    gc.ranks.gather("t")         # [tensor([3.]), tensor([3.])]: plain data, in rank order

One cell, as :meth:`LiveRanks.run` does it:

1) send the cell's code to each chosen rank (``%%ranks``: all; ``%%ranks 0,2``: those);
2) wait for each rank's reply, one deadline for the cell (``--timeout``, default 60 s). A rank that
   raised shortens it: the others get a few seconds more, since they are likely waiting for it in
   a collective;
3) ranks still busy at the deadline: ask each where it is (a Python stack), then interrupt it
   (``KeyboardInterrupt``). A rank stuck inside a collective cannot be interrupted — then the group
   is broken, and it is stopped: :meth:`LiveRanks.restart` starts a fresh one in well under 5 s;
4) show each rank's output in rank order, all of it before the next rank's, lines labelled
   ``[rank r]``: stdout, stderr, then its figures — the same every run, so nbval can compare it;
5) raise :class:`RankError` (a rank raised or died; its traceback, rank-labelled) or
   :class:`RankTimeout` (the ranks still busy and where they were), so the cell fails — and a
   notebook under nbval or ``make test`` with it.

**Why forked processes, not one Jupyter kernel per rank.** The ranks are forks of the notebook's
kernel started the way ``gc.launch`` starts its ranks (the same loopback store, the same process
setup, the same process-tree cleanup), talking to the kernel over pipes. That starts 2 ranks in
about 0.3 s and runs a trivial cell in about a millisecond; one ipykernel per rank through
``jupyter_client`` took ~5.7 s for 2 ranks and ~8.7 s for 4 (targets: 4 s and 7 s) and adds a
ZMQ round trip per cell. What a kernel per rank would give — rich output — the ranks do here for
what the lessons need: the last expression's ``repr``, ``print``, and matplotlib figures (drawn
with Agg in the rank and shown in the notebook as PNG). Tracebacks carry the cell's source lines.

**Nothing outlives the notebook.** The ranks are children of a *keeper* (a small fork of the
kernel, see :mod:`~gpucourse.runtime.live_rank_process`) that is a child subreaper — whatever a
rank starts stays below it — and that reads a pipe from the kernel: when the kernel exits or is
killed (even ``kill -9``), the pipe closes, and the keeper kills every process below it and exits.
Each rank also dies with the keeper (``PR_SET_PDEATHSIG``). Nothing is killed by name.

**Loopback only.** The store listens on ``127.0.0.1`` (hosted by the kernel, as ``gc.launch``
hosts it), gloo on the loopback interface, the kernel talks to the ranks over unix socket pairs.

:data:`ranks` is this kernel's one group — the one ``%%ranks`` runs on and ``gc.start_ranks``
starts; a script or a test may hold its own :class:`LiveRanks` as well.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as _wait_for
from typing import Any

from .live_rank_process import CELL_PREFIX, keeper_main
from .ports import host_store, loopback_interface
from .processes import warm_parent
from .rank_output import read, tidy_stack
from .validate import check_int, check_positive

__all__ = ["LiveRanks", "RankError", "RankTimeout", "ranks", "start_ranks"]

_PEER_GRACE = 3.0        # s the other ranks get after one raised or died (then they are interrupted)
_INTERRUPT_GRACE = 1.0   # s an interrupted rank gets to return to its loop before the group is stopped
_MACHINERY = os.path.join("gpucourse", "runtime", "live_rank_process.py")


class RankError(RuntimeError):
    """A live rank raised (or died) in a cell; the message holds each rank's traceback, labelled.

    Attributes:
        ranks: the ranks that raised or died, in rank order.
        exc_types: ``{rank: exception type name}`` (``None`` for a rank that died without raising).
        tracebacks: ``{rank: traceback text}`` as printed in that rank.
        stopped: whether the group had to be stopped (a rank died, or a rank still blocked could
            not be interrupted); then :meth:`LiveRanks.restart` starts a fresh one.
    """

    def __init__(self, message: str, *, ranks: list[int], exc_types: dict, tracebacks: dict,
                 stopped: bool = False):
        super().__init__(message)
        self.ranks, self.exc_types, self.tracebacks, self.stopped = ranks, exc_types, tracebacks, stopped

    def __reduce__(self):  # keep the attributes when pickled (pytest-xdist, a grader's pipe)
        return (_rebuild, (type(self), str(self), self.__dict__))

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the ranks' tracebacks, not the kernel-side frames that relayed them."""
        return _render(self)


class RankTimeout(TimeoutError):
    """Live ranks were still busy when a cell's timeout passed.

    Attributes:
        ranks: the ranks still busy, in rank order.
        stacks: ``{rank: where it was}`` (the Python stack, innermost call first).
        stopped: whether the group had to be stopped (a rank blocked in a collective or a ``recv``
            cannot be interrupted); otherwise they were interrupted and the group lives on.
    """

    def __init__(self, message: str, *, ranks: list[int], stacks: dict, stopped: bool):
        super().__init__(message)
        self.ranks, self.stacks, self.stopped = ranks, stacks, stopped

    def __reduce__(self):
        return (_rebuild, (type(self), str(self), self.__dict__))

    def _render_traceback_(self) -> list[str]:
        return _render(self)


def _render(error: BaseException) -> list[str]:
    name = f"\x1b[0;31m{type(error).__name__}\x1b[0m"    # red, as IPython shows an exception's name
    return f"{name}: {error}".splitlines()


def _rebuild(cls, message, state):
    error = cls.__new__(cls)
    BaseException.__init__(error, message)
    error.__dict__.update(state)
    return error


class LiveRanks:
    """``world_size`` rank processes in one gloo process group, kept between cells.

    Use :func:`start_ranks` (or ``.start``), then the ``%%ranks`` cell magic or :meth:`run`; read
    values back with :meth:`gather`, send values with :meth:`push` / :meth:`scatter`; end with
    :meth:`stop` (the kernel's exit does it too). Each rank has ``rank``, ``world_size``, ``dist``
    (``torch.distributed``) and ``torch`` bound, and keeps its own variables between cells.

    Example::

        >>> with LiveRanks().start(2) as group:
        ...     group.run("t = torch.tensor([rank + 1.0])\\ndist.all_reduce(t)\\nprint(t)")
        ...     group.run("t * 10", ranks=[1])
        ...     print(group.gather("t.item()"))
        [rank 0] tensor([3.])
        [rank 1] tensor([3.])
        [rank 1] tensor([30.])
        [3.0, 3.0]

    .. warning::
        The ranks are *forks* of this process, started with the kernel's state at that moment
        (modules already imported come for free), but afterwards they share nothing with it:
        a function defined in a notebook cell later is not known to the ranks — define it in a
        ``%%ranks`` cell, or send it with :meth:`push`. They use the CPU and gloo; a rank that
        blocks in a collective cannot be interrupted, only stopped (:class:`RankTimeout`).
    """

    def __init__(self):
        self._group: _Group | None = None
        self._why_stopped = "they were never started: call gc.start_ranks(n) first"
        self._cells = 0
        self._last_world_size: int | None = None
        self.timeout = 60.0

    # --- start and stop ------------------------------------------------------------------------
    def start(self, world_size: int = 2, *, timeout: float = 60.0) -> LiveRanks:
        """Start ``world_size`` ranks that join a fresh gloo group (stopping any running ones first).

        Args:
            world_size: number of rank processes.
            timeout: seconds for joining the group, and the default timeout of every cell.

        Returns:
            ``self``, once every rank has joined the group.
        """
        check_int("world_size", world_size, 1)
        check_positive("timeout", timeout)
        if not hasattr(os, "fork"):
            raise RuntimeError("live ranks are forks of this process, and this platform has no fork(); "
                               "use gc.launch(fn, n), which also works with spawn")
        self.stop()
        warm_parent()                       # torch._dynamo imported once here, not in every rank
        self._group = _Group.start(world_size, timeout)
        self._finalizer = weakref.finalize(self, self._group.stop)   # at exit, or when dropped
        self.timeout = float(timeout)
        self._last_world_size = world_size
        return self

    def restart(self, world_size: int | None = None) -> LiveRanks:
        """Stop the ranks (variables are lost) and start a fresh group of ``world_size`` (default: as before)."""
        n = world_size if world_size is not None else self._last_world_size
        if n is None:
            raise RuntimeError("restart() does not know how many ranks to start: call "
                               "gc.start_ranks(n), or restart(n)")
        return self.start(n, timeout=self.timeout)

    def stop(self) -> None:
        """Stop every rank and everything it started. Safe to call twice."""
        group, self._group = self._group, None
        if group is not None:
            self._finalizer.detach()
            group.stop()
            self._why_stopped = "they were stopped with stop(): gc.ranks.restart() starts them again"

    def __enter__(self) -> LiveRanks:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """Whether the ranks are up (started, not stopped, not broken by a hang)."""
        return self._group is not None

    @property
    def world_size(self) -> int:
        """How many ranks are running (0 when stopped)."""
        return self._group.world_size if self._group else 0

    @property
    def pids(self) -> list[int]:
        """The process id of each rank, in rank order (empty when stopped)."""
        return list(self._group.pids) if self._group else []

    def __repr__(self) -> str:
        if self._group is None:
            return "<LiveRanks: not running>"
        return f"<LiveRanks: {self.world_size} ranks running, gloo, default cell timeout {self.timeout:g} s>"

    # --- run code ------------------------------------------------------------------------------
    def run(self, code: str, ranks: int | Iterable[int] | None = None, *, timeout: float | None = None) -> None:
        """Run ``code`` on ``ranks`` (default: all) and show their output in rank order.

        The last line, if it is an expression, shows its ``repr`` (end it with ``;`` to hide it).

        Raises:
            RankError: a rank raised or died (its traceback, labelled ``[rank r]``).
            RankTimeout: ranks were still busy after ``timeout`` seconds (default: the group's).
        """
        __tracebackhide__ = True  # IPython leaves this frame out of the traceback it shows
        if not isinstance(code, str):
            raise TypeError(f"code must be a str of Python source, got {type(code).__name__}")
        self._cells += 1
        filename = f"{CELL_PREFIX}cell {self._cells}>"
        self._round({r: ("exec", code, filename) for r in self._chosen(ranks)}, timeout)

    def gather(self, expression: str, ranks: int | Iterable[int] | None = None, *,
               timeout: float | None = None) -> list:
        """The value of ``expression`` (a variable's name, or any expression) on each rank, in rank order.

        Values come back as plain data: tensors detached, on the CPU, each with storage of its
        own (a ``DTensor`` as this rank's local shard), numbers, strings, numpy arrays and
        lists/tuples/dicts of them; anything else raises :class:`RankError` (a ``TypeError`` in
        the rank) naming what it found. Nothing the ranks hold is changed.
        """
        __tracebackhide__ = True  # IPython leaves this frame out of the traceback it shows
        if not isinstance(expression, str):
            raise TypeError(f"expression must be a str such as 'x' or 'x.shape', got {type(expression).__name__}")
        self._cells += 1
        filename = f"{CELL_PREFIX}gather {self._cells}>"
        chosen = self._chosen(ranks)
        values = self._round({r: ("gather", expression, filename) for r in chosen}, timeout)
        return [pickle.loads(values[r]) for r in chosen]

    def push(self, values: dict[str, Any], ranks: int | Iterable[int] | None = None, *,
             timeout: float | None = None) -> None:
        """Bind ``values`` (``{name: value}``) in each of ``ranks`` (default: all), the same on each.

        Values travel pickled — by value for functions and classes defined in the notebook
        (cloudpickle), so a function written in an ordinary cell can be sent to the ranks.
        """
        __tracebackhide__ = True  # IPython leaves this frame out of the traceback it shows
        payload = _dumps(_names(values))
        self._round({r: ("push", payload) for r in self._chosen(ranks)}, timeout)

    def scatter(self, name: str, values: list, *, timeout: float | None = None) -> None:
        """Bind ``name`` to ``values[r]`` on rank ``r``: one value per rank, in rank order."""
        __tracebackhide__ = True  # IPython leaves this frame out of the traceback it shows
        _names({name: None})
        group = self._live()
        if not isinstance(values, (list, tuple)) or len(values) != group.world_size:
            raise ValueError(f"scatter({name!r}, values) needs one value per rank: a list of "
                             f"{group.world_size}, got {type(values).__name__} of length "
                             f"{len(values) if hasattr(values, '__len__') else '?'}")
        self._round({r: ("push", _dumps({name: v})) for r, v in enumerate(values)}, timeout)

    # --- one round: send, wait, show, raise ------------------------------------------------------
    def _round(self, messages: dict[int, tuple], timeout: float | None) -> dict[int, Any]:
        """Send each rank its message; wait; show the output in rank order; return values or raise."""
        __tracebackhide__ = True  # IPython leaves this frame out of the traceback it shows
        group = self._live()
        timeout = self.timeout if timeout is None else check_positive("timeout", timeout)
        # 1) send; 2) wait
        outcome = group.exchange(messages, timeout)
        # 3) still busy: where were they? then interrupt them; stop the group if that fails
        if outcome.late:
            if not outcome.interrupted_here:
                outcome.stacks = group.stacks_of(outcome.late)
            group.interrupt(outcome, _INTERRUPT_GRACE)
        broken = bool(outcome.stuck or outcome.died)
        # 4) output of every rank, in rank order, complete before the next one's
        group.show(sorted(messages), outcome)
        if broken:
            self._broken(outcome)
        if outcome.interrupted_here:
            raise KeyboardInterrupt
        # 5) errors fail the cell
        _raise_for(outcome, sorted(messages), timeout, stopped=broken)
        return {r: reply[3] for r, reply in outcome.replies.items()}

    def _broken(self, outcome: _Outcome) -> None:
        if outcome.died:
            why = f"{_who(sorted(outcome.died))} died"
        else:
            why = f"{_who(outcome.stuck)} stayed blocked (a collective or a recv cannot be interrupted)"
        self.stop()
        self._why_stopped = (f"{why} in an earlier cell, so the group was stopped: gc.ranks.restart() "
                             "starts a fresh one (the ranks' variables are lost)")

    def _live(self) -> _Group:
        if self._group is None:
            raise RuntimeError(f"no live ranks: {self._why_stopped}")
        return self._group

    def _chosen(self, ranks) -> list[int]:
        group = self._live()
        if ranks is None:
            return list(range(group.world_size))
        chosen = [ranks] if isinstance(ranks, int) else list(ranks)
        if not chosen:
            raise ValueError("ranks must name at least one rank, got an empty list")
        for r in chosen:
            check_int("rank", r, 0, maximum=group.world_size - 1,
                      hint=f" (the group has ranks 0..{group.world_size - 1})")
        return sorted(set(chosen))


#: this kernel's live ranks: the group ``%%ranks`` runs on (``gc.ranks``); started by :func:`start_ranks`
ranks = LiveRanks()


def start_ranks(world_size: int = 2, *, timeout: float = 60.0) -> LiveRanks:
    """Start ``world_size`` live ranks in a gloo group and register the ``%%ranks`` cell magic.

    Returns :data:`ranks` (also ``gc.ranks``), this kernel's group; calling it again replaces the
    running ranks by fresh ones. In a notebook::

        gc.start_ranks(2)

        %%ranks                   # all ranks;  %%ranks 0  or  %%ranks 0,2  for some;  --timeout 30
        x = torch.full((2,), float(rank))

        gc.ranks.gather("x")      # [tensor([0., 0.]), tensor([1., 1.])]

    Args:
        world_size: number of ranks.
        timeout: seconds to join the group, and the default time limit of each cell.

    Example::

        >>> group = start_ranks(2)
        >>> group.gather("rank * 10")
        [0, 10]
        >>> group.stop()
    """
    ranks.start(world_size, timeout=timeout)
    _register_magic()
    return ranks


# --- the %%ranks cell magic --------------------------------------------------------------------------

_USAGE = "usage: %%ranks [RANKS] [--timeout SECONDS]   e.g. %%ranks,  %%ranks 0,  %%ranks 0,2 --timeout 30"


def parse_magic_line(line: str) -> tuple[list[int] | None, float | None]:
    """``"0,2 --timeout 30"`` → ``([0, 2], 30.0)``; ``""`` → ``(None, None)`` (all ranks, the default).

    Example::

        >>> parse_magic_line("1 --timeout=5")
        ([1], 5.0)
    """
    tokens = line.replace("--timeout=", "--timeout ").split()
    chosen: list[int] | None = None
    timeout: float | None = None
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--timeout":
            if i + 1 == len(tokens):
                raise ValueError(f"--timeout needs a number of seconds. {_USAGE}")
            try:
                timeout = float(tokens[i + 1])
            except ValueError:
                raise ValueError(f"--timeout must be a number of seconds, got {tokens[i + 1]!r}. {_USAGE}") from None
            if not timeout > 0:
                raise ValueError(f"--timeout must be > 0, got {tokens[i + 1]}. {_USAGE}")
            i += 2
            continue
        if not re.fullmatch(r"\d+(,\d+)*,?", token):
            raise ValueError(f"cannot read {token!r} as ranks. {_USAGE}")
        chosen = (chosen or []) + [int(r) for r in token.split(",") if r]
        i += 1
    return chosen, timeout


def _ranks_magic(line: str, cell: str) -> None:
    """%%ranks [RANKS] [--timeout SECONDS]: run this cell on the live ranks (all, or those listed)."""
    __tracebackhide__ = True  # IPython leaves this frame out of the traceback it shows
    from IPython.core.error import UsageError

    try:
        chosen, timeout = parse_magic_line(line)
        ranks._chosen(chosen)                 # no live ranks, or a rank that does not exist
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None
    ranks.run(cell, chosen, timeout=timeout)


def _register_magic() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False
    shell.register_magic_function(_ranks_magic, magic_kind="cell", magic_name="ranks")
    return True


# --- the group, seen from the kernel ------------------------------------------------------------------

@dataclass
class _Outcome:
    """What came back from one round."""

    replies: dict[int, tuple] = field(default_factory=dict)   # rank -> ("done", seq, error, value, out, err, figs)
    died: dict[int, int | None] = field(default_factory=dict)  # rank -> exit status
    late: list[int] = field(default_factory=list)              # busy at the deadline (or on Ctrl-C)
    stuck: list[int] = field(default_factory=list)             # late, and not even an interrupt helped
    stacks: dict[int, str] = field(default_factory=dict)
    interrupted_here: bool = False                             # Ctrl-C in the kernel


_OPEN: weakref.WeakSet[_Group] = weakref.WeakSet()   # running groups: a new keeper closes their pipe ends


class _Group:
    """One running group: the keeper's pid and pipe, a pipe per rank, the store, the output files."""

    def __init__(self, world_size, keeper_pid, keeper, conns, folder, store=None):
        self.world_size, self.keeper_pid, self.keeper, self.conns = world_size, keeper_pid, keeper, conns
        self.folder, self.store, self.owner = folder, store, os.getpid()
        self.pids: list[int] = [0] * world_size
        self.out_pos, self.err_pos, self.stack_pos = [0] * world_size, [0] * world_size, [0] * world_size
        self.exit_codes: dict[int, int] = {}
        self.seq = 0
        self.stopped = False
        self.keeper_alive = True

    def path(self, rank: int, kind: str) -> str:
        return os.path.join(self.folder, f"rank{rank}.{kind}")

    # --- start -------------------------------------------------------------------------------------
    @classmethod
    def start(cls, world_size: int, timeout: float) -> _Group:
        folder = tempfile.mkdtemp(prefix="gpucourse-ranks-")
        pairs = [mp.Pipe(duplex=True) for _ in range(world_size)]       # (kernel's end, rank's end)
        keeper_here, keeper_there = mp.Pipe(duplex=True)
        close_in_child = [keeper_here, *(here for here, _ in pairs)]
        close_in_child += [c for g in list(_OPEN) for c in (g.keeper, *g.conns)]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            pid = os.fork()
        if pid == 0:   # the keeper
            try:
                keeper_main(keeper_there, [there for _, there in pairs], close_in_child,
                            world_size=world_size, folder=folder, launch_id=secrets.token_hex(8),
                            loopback=loopback_interface(), start_timeout=timeout)
            finally:
                os._exit(70)
        keeper_there.close()
        for _, there in pairs:
            there.close()
        group = cls(world_size, pid, keeper_here, [here for here, _ in pairs], folder)
        _OPEN.add(group)
        try:
            # the store, created after the fork so no rank inherits its socket; 127.0.0.1 only
            group.store = host_store(timeout)
            for conn in group.conns:
                conn.send(("port", group.store.port))
            group._wait_until_ready(timeout)
        except BaseException:
            group.stop()
            raise
        return group

    def _wait_until_ready(self, timeout: float) -> None:
        __tracebackhide__ = True  # IPython leaves this frame out of the traceback it shows
        deadline = time.monotonic() + timeout
        waiting = set(range(self.world_size))
        by_conn = {c: r for r, c in enumerate(self.conns)}
        while waiting:
            ready = _wait_for([self.conns[r] for r in waiting], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(waiting)
                raise RankTimeout(f"start_ranks: rank(s) {late} of {self.world_size} did not join the "
                                  f"process group within {timeout:g} s (a machine too busy, or a "
                                  "firewall blocking loopback ports). Nothing was left running.",
                                  ranks=late, stacks={}, stopped=True)
            for conn in ready:
                r = by_conn[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = ("failed", read(self.path(r, "err")) or "(it died and printed nothing)")
                if msg[0] == "failed":
                    tb = msg[1]
                    raise RankError(f"start_ranks: rank {r} could not join the process group\n"
                                    + _labelled(f"rank {r}", tb), ranks=[r], exc_types={r: None},
                                    tracebacks={r: tb}, stopped=True)
                _, self.pids[r], self.out_pos[r], self.err_pos[r] = msg
                waiting.discard(r)

    # --- a round ------------------------------------------------------------------------------------
    def exchange(self, messages: dict[int, tuple], timeout: float) -> _Outcome:
        """Send each rank its message and collect the replies until all came or the deadline passed."""
        self.seq += 1
        outcome = _Outcome()
        busy = set()
        for r, (kind, *rest) in messages.items():
            try:
                self.conns[r].send((kind, self.seq, *rest))
                busy.add(r)
            except (BrokenPipeError, OSError):
                outcome.died[r] = self._exit_code(r)
        deadline = time.monotonic() + timeout
        try:
            while busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                keeper = [self.keeper] if self.keeper_alive else []
                ready = _wait_for([self.conns[r] for r in busy] + keeper, timeout=remaining)
                for conn in ready:
                    if conn is self.keeper:
                        self._keeper_news()
                        continue
                    r = self.conns.index(conn)
                    try:
                        reply = conn.recv()
                    except (EOFError, OSError):
                        outcome.died[r] = self._exit_code(r)
                        busy.discard(r)
                    else:
                        if reply[1] != self.seq:    # a late reply to an earlier round
                            continue
                        outcome.replies[r] = reply
                        busy.discard(r)
                        if reply[2] is None:
                            continue
                    # one rank failed: the others are probably waiting for it in a collective
                    deadline = min(deadline, time.monotonic() + _PEER_GRACE)
        except KeyboardInterrupt:               # the notebook's stop button
            outcome.interrupted_here = True
        outcome.late = sorted(busy)
        return outcome

    def stacks_of(self, late: list[int]) -> dict[int, str]:
        """Where each late rank is now: faulthandler writes its Python stack on SIGUSR1."""
        if not hasattr(signal, "SIGUSR1"):
            return {}
        for r in late:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pids[r], signal.SIGUSR1)
        deadline = time.monotonic() + 1.0
        stacks = {}
        for r in late:
            path = self.path(r, "stack")
            while time.monotonic() < deadline and os.path.getsize(path) <= self.stack_pos[r]:
                time.sleep(0.01)
            time.sleep(0.02)   # let the dump finish
            text = _read_range(path, self.stack_pos[r], None)
            self.stack_pos[r] += len(text.encode())
            stacks[r] = _short_paths(tidy_stack(text, machinery=_MACHINERY))
        return stacks

    def interrupt(self, outcome: _Outcome, grace: float) -> None:
        """SIGINT each late rank (KeyboardInterrupt in its cell); those that do not reply are stuck."""
        late = set(outcome.late)
        for r in late:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pids[r], signal.SIGINT)
        deadline = time.monotonic() + grace
        while late and time.monotonic() < deadline:
            for conn in _wait_for([self.conns[r] for r in late], timeout=max(0.0, deadline - time.monotonic())):
                r = self.conns.index(conn)
                try:
                    reply = conn.recv()
                except (EOFError, OSError):
                    outcome.died[r] = self._exit_code(r)
                    late.discard(r)
                    continue
                if reply[1] == self.seq:
                    outcome.replies[r] = reply
                    late.discard(r)
        outcome.stuck = sorted(late)

    def show(self, chosen: list[int], outcome: _Outcome) -> None:
        """Each chosen rank's stdout, stderr and figures from this round, in rank order."""
        figures_from = [r for r in chosen if r in outcome.replies and outcome.replies[r][6]]
        for r in chosen:
            reply = outcome.replies.get(r)
            out_end, err_end = (reply[4], reply[5]) if reply else (None, None)
            out = _read_range(self.path(r, "out"), self.out_pos[r], out_end)
            err = _read_range(self.path(r, "err"), self.err_pos[r], err_end)
            self.out_pos[r] += len(out.encode())
            self.err_pos[r] += len(err.encode())
            if out:
                sys.stdout.write(_labelled(f"rank {r}", out))
                sys.stdout.flush()
            if err:
                sys.stderr.write(_labelled(f"rank {r}", err))
                sys.stderr.flush()
            for png in reply[6] if reply else ():
                _show_png(png, r, label=len(figures_from) > 1)

    # --- keeper and exit codes -------------------------------------------------------------------
    def _keeper_news(self) -> None:
        """Read what the keeper reported (ranks that exited); notice when the keeper is gone."""
        try:
            while self.keeper.poll(0):
                msg = self.keeper.recv()
                if msg[0] == "exited":
                    self.exit_codes[msg[1]] = msg[2]
        except (EOFError, OSError):
            self.keeper_alive = False

    def _exit_code(self, rank: int) -> int | None:
        """The exit status of a rank whose pipe closed (the keeper reports it within ~0.2 s)."""
        deadline = time.monotonic() + 1.0
        while rank not in self.exit_codes and self.keeper_alive:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not _wait_for([self.keeper], timeout=remaining):
                break
            self._keeper_news()
        return self.exit_codes.get(rank)

    # --- stop ----------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the keeper to kill everything below it; wait for it (SIGKILL after 10 s); close all."""
        if self.stopped or os.getpid() != self.owner:
            return
        self.stopped = True
        _OPEN.discard(self)
        with contextlib.suppress(Exception):
            self.keeper.send(("stop",))
        interrupted = False
        while True:
            try:
                self._wait_for_keeper(10.0)
                break
            except KeyboardInterrupt:   # a Ctrl-C must never leave ranks running
                interrupted = True
        for conn in (self.keeper, *self.conns):
            conn.close()
        self.store = None
        shutil.rmtree(self.folder, ignore_errors=True)
        if interrupted:
            raise KeyboardInterrupt

    def _wait_for_keeper(self, seconds: float) -> None:
        """Reap the keeper once it has killed everything below it (SIGKILL it after ``seconds``)."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                done, _ = os.waitpid(self.keeper_pid, os.WNOHANG)
            except ChildProcessError:
                return
            if done:
                return
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.keeper_pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.keeper_pid, 0)
                return
            time.sleep(0.002)


# --- reports -----------------------------------------------------------------------------------------

def _raise_for(outcome: _Outcome, chosen: list[int], timeout: float, *, stopped: bool) -> None:
    __tracebackhide__ = True  # IPython leaves this frame out of the traceback it shows
    errors = {r: reply[2] for r, reply in outcome.replies.items() if reply[2] is not None}
    late = set(outcome.late)
    raised = {r: e for r, e in errors.items() if r not in late}        # errors of their own
    if raised or outcome.died:
        failed = sorted(set(raised) | set(outcome.died))
        exc_types = {r: raised[r][0] if r in raised else None for r in failed}
        tracebacks = {r: raised[r][1] for r in raised}
        parts = []
        for r in sorted(outcome.died):
            parts.append(f"rank {r} died with {_signal_name(outcome.died[r])}")
        summary = _summary(raised)
        if summary:
            parts.insert(0, summary)
        message = "; ".join(parts)
        if late:
            fate = ("could not be interrupted" if outcome.stuck
                    else "got interrupted")
            message += (f"; {_who(sorted(late))} still running {_PEER_GRACE:g} s later (waiting "
                        f"for the failed rank in a collective?) {fate}")
        if stopped:
            message += ". The live ranks were stopped: gc.ranks.restart() starts a fresh group"
        message += "\n" + _tracebacks(tracebacks)
        raise RankError(message.rstrip("\n"), ranks=failed, exc_types=exc_types, tracebacks=tracebacks,
                        stopped=stopped)
    if late:
        where = "".join(f"\n--- {_who([r])} was here ---\n{outcome.stacks.get(r) or '(no stack)'}" for r in sorted(late))
        if stopped:
            fate = ("A rank blocked inside a collective or a recv cannot be interrupted, so the group was "
                    "stopped: gc.ranks.restart() starts a fresh one (the ranks' variables are lost).")
        else:
            fate = "Interrupted (KeyboardInterrupt): the group is still up, its variables kept."
        others = " (the others had finished)" if len(late) < len(chosen) else ""
        raise RankTimeout(
            f"{_who(sorted(late))} still busy after {timeout:g} s{others}. Usual causes: a collective "
            f"that only some ranks call, a recv with no matching send, an endless loop. {fate}{where}",
            ranks=sorted(late), stacks=dict(outcome.stacks), stopped=stopped)


def _short_paths(stack: str) -> str:
    """A stack as a learner reads it: ``torch/distributed/...`` without the install's folders, no
    thread addresses (which change every run)."""
    stack = re.sub(r"(Current thread|Thread) 0x[0-9a-fA-F]+ ", r"\1 ", stack)
    return re.sub(r'File "[^"]*[/\\](?:site|dist)-packages[/\\]', 'File "', stack)


def _summary(raised: dict[int, tuple]) -> str:
    """``"rank 1 raised KeyError: 'x'"``; ranks with the same last line are named together."""
    by_line: dict[str, list[int]] = {}
    for r in sorted(raised):
        lines = raised[r][1].strip().splitlines()
        by_line.setdefault(lines[-1] if lines else raised[r][0], []).append(r)
    return "; ".join(f"{_who(rs)} raised {line}" for line, rs in by_line.items())


def _tracebacks(tracebacks: dict[int, str]) -> str:
    """Each rank's traceback, every line labelled; identical ones once, labelled with all their ranks."""
    by_text: dict[str, list[int]] = {}
    for r in sorted(tracebacks):
        by_text.setdefault(tracebacks[r], []).append(r)
    return "".join(_labelled(_who(rs), text) for text, rs in by_text.items())


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))


def _labelled(who: str, text: str) -> str:
    return "".join(f"[{who}] {line}\n" for line in text.splitlines())


def _signal_name(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def _read_range(path: str, start: int, end: int | None) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(max(0, end - start))
    except FileNotFoundError:
        return ""
    return data.decode("utf-8", errors="replace")


def _show_png(png: bytes, rank: int, label: bool) -> None:
    """A rank's figure: shown in a notebook (labelled when several ranks drew), one line elsewhere."""
    from .printing import in_kernel

    if in_kernel():
        from IPython.display import Image, display

        if label:
            print(f"[rank {rank}] figure:", flush=True)
        display(Image(data=png, format="png"))
    else:
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
        print(f"[rank {rank}] <figure {width}x{height} px: shown as a picture in a notebook>", flush=True)


def _names(values) -> dict:
    if not isinstance(values, dict):
        raise TypeError(f"values must be a dict {{name: value}}, got {type(values).__name__}")
    for name in values:
        if not (isinstance(name, str) and name.isidentifier()):
            raise ValueError(f"each name must be a Python identifier, got {name!r}")
    return values


def _dumps(values: dict) -> bytes:
    """Pickled for the ranks — functions and classes from the notebook by value (cloudpickle)."""
    try:
        import cloudpickle
    except ImportError:  # pragma: no cover - a dependency of the course
        return pickle.dumps(values)
    try:
        return cloudpickle.dumps(values)
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"push: these values cannot be sent to the ranks ({type(e).__name__}: {e}); "
                        "send plain data, functions or classes, and create locks, files or "
                        "connections on the ranks") from None
