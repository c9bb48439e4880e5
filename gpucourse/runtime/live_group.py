"""The live ranks seen from the kernel: start a group, exchange one round of messages, stop it.

:class:`~gpucourse.runtime.live_ranks.LiveRanks` is the algorithm; this is its transport and its
reports: ``LiveGroup.start`` forks the keeper (which forks the ranks), hosts the store on
``127.0.0.1`` and waits until every rank has joined; ``exchange`` sends each rank its message and
collects the replies until the deadline; ``stacks_of`` and ``interrupt`` deal with ranks still
busy; ``show`` prints what each rank wrote, in rank order; ``stop`` has the keeper kill everything.
:func:`raise_for` turns a round's outcome into :class:`RankError` or :class:`RankTimeout`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
import warnings
import weakref
from dataclasses import dataclass, field

from .live_rank_process import keeper_main
from .ports import host_store, loopback_interface
from .processes import wait_ready as _wait_for
from .rank_output import abort_reason, blocked_report, exception_line, rank_died, read, tidy_stack

__all__ = ["RankError", "RankTimeout", "LiveGroup", "Outcome", "raise_for", "who"]

PROGRESS_EVERY = 0.25    # s between two looks at the busy ranks, for a live progress line
PEER_GRACE = 3.0         # s the other ranks get after one raised or died (then they are interrupted)
_MACHINERY = os.path.join("gpucourse", "runtime", "live_rank_process.py")


class RankError(RuntimeError):
    """A live rank raised (or died) in a cell; the message holds each rank's traceback, labelled.

    Attributes:
        ranks: the ranks that raised or died, in rank order.
        exc_types: ``{rank: exception type name}`` (``None`` for a rank that died without raising).
        tracebacks: ``{rank: traceback text}`` as printed in that rank.
        stopped: whether the group had to be stopped (a rank died, or a rank still blocked could
            not be interrupted); then :meth:`LiveRanks.restart` starts a fresh one.

    Example::

        >>> import gpucourse as gc
        >>> with gc.LiveRanks().start(2) as group:
        ...     try:
        ...         group.run("if rank == 1:\\n    raise KeyError('lost')")
        ...     except gc.RankError as e:
        ...         print(e.ranks, e.exc_types, e.stopped, "|", str(e).splitlines()[0])
        [1] {1: 'KeyError'} False | rank 1 raised KeyError: 'lost'
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
        blocked: one line naming where each rank waits (its ``torch.distributed`` call and the
            cell's line) and, for a known pattern, why ("both ranks send first").

    Example::

        >>> import gpucourse as gc
        >>> with gc.LiveRanks().start(2) as group:
        ...     try:
        ...         group.run("if rank == 0:\\n    dist.barrier()", timeout=1)   # rank 1 never comes
        ...     except gc.RankTimeout as e:
        ...         print(e.ranks, e.stopped, "in barrier" in e.stacks[0], group.running)
        [0] True True False
    """

    def __init__(self, message: str, *, ranks: list[int], stacks: dict, stopped: bool, blocked: str = ""):
        super().__init__(message)
        self.ranks, self.stacks, self.stopped = ranks, stacks, stopped
        self.blocked = blocked        # where each rank waits, one line ("rank 0 in send (line 2 …), …")

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


# --- the group, seen from the kernel ------------------------------------------------------------------

@dataclass
class Outcome:
    """What came back from one round."""

    replies: dict[int, tuple] = field(default_factory=dict)   # rank -> ("done", seq, error, value, out, err, figs)
    died: dict[int, int | None] = field(default_factory=dict)  # rank -> exit status
    late: list[int] = field(default_factory=list)              # busy at the deadline (or on Ctrl-C)
    stuck: list[int] = field(default_factory=list)             # late, and not even an interrupt helped
    stacks: dict[int, str] = field(default_factory=dict)
    interrupted_here: bool = False                             # Ctrl-C in the kernel
    reasons: dict[int, str] = field(default_factory=dict)      # a dead rank: why C++ aborted it (its stderr)


_OPEN: weakref.WeakSet[LiveGroup] = weakref.WeakSet()   # running groups: a new keeper closes their pipe ends


class LiveGroup:
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
        self.files: dict = {}              # (rank, "out" | "err" | "stack") -> file open for reading

    def path(self, rank: int, kind: str) -> str:
        return os.path.join(self.folder, f"rank{rank}.{kind}")

    # --- start -------------------------------------------------------------------------------------
    @classmethod
    def start(cls, world_size: int, timeout: float) -> LiveGroup:
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
            group._keep_files_open()
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

    def _keep_files_open(self) -> None:
        """Open every rank's output files for reading, then remove the folder: the open files
        outlive their names, and no folder is left behind whatever ends this group — even a
        SIGKILL of the kernel *and* the keeper at once (a grader's sandbox ends its tree so)."""
        self.files = {(r, kind): open(self.path(r, kind), "rb")   # noqa: SIM115 - closed in stop()
                      for r in range(self.world_size) for kind in ("out", "err", "stack")}
        shutil.rmtree(self.folder, ignore_errors=True)

    # --- a round ------------------------------------------------------------------------------------
    def exchange(self, messages: dict[int, tuple], timeout: float, progress=None) -> Outcome:
        """Send each rank its message and collect the replies until all came or the deadline passed.

        ``progress(busy, outcome)``, if given, is called about every :data:`PROGRESS_EVERY` seconds
        while ranks are busy (a notebook's live line per rank)."""
        self.seq += 1
        outcome = Outcome()
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
                if progress is not None:
                    progress(busy, outcome)
                    remaining = min(remaining, PROGRESS_EVERY)
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
                    deadline = min(deadline, time.monotonic() + PEER_GRACE)
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
            file = self.files[r, "stack"]
            while time.monotonic() < deadline and os.fstat(file.fileno()).st_size <= self.stack_pos[r]:
                time.sleep(0.01)
            time.sleep(0.02)   # let the dump finish
            text = _read_range(file, self.stack_pos[r], None)
            self.stack_pos[r] += len(text.encode())
            stacks[r] = _short_paths(tidy_stack(text, machinery=_MACHINERY))
        return stacks

    def interrupt(self, outcome: Outcome, grace: float) -> None:
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

    def show(self, chosen: list[int], outcome: Outcome) -> None:
        """Each chosen rank's stdout, stderr and figures from this round, in rank order."""
        figures_from = [r for r in chosen if r in outcome.replies and outcome.replies[r][6]]
        for r in chosen:
            reply = outcome.replies.get(r)
            out_end, err_end = (reply[4], reply[5]) if reply else (None, None)
            out = _read_range(self.files[r, "out"], self.out_pos[r], out_end)
            err = _read_range(self.files[r, "err"], self.err_pos[r], err_end)
            self.out_pos[r] += len(out.encode())
            self.err_pos[r] += len(err.encode())
            if r in outcome.died and err:
                # a rank C++ aborted (gloo: a message larger than its buffer): the reason in the
                # error's first line, and of its fatal-error dump the learner's frames only
                outcome.reasons[r] = abort_reason(err)
                err = _short_paths(tidy_stack(err, machinery=_MACHINERY)) + "\n"
            if out:
                sys.stdout.write(_labelled(f"rank {r}", out))
                sys.stdout.flush()
            if err:
                sys.stderr.write(_labelled(f"rank {r}", err))
                sys.stderr.flush()
            for png in reply[6] if reply else ():
                _show_png(png, r, label=len(figures_from) > 1)

    def last_line(self, rank: int) -> str:
        """The last line rank ``rank`` printed in this round so far ("" if none)."""
        file = self.files.get((rank, "out"))
        if file is None:
            return ""
        size = os.fstat(file.fileno()).st_size
        text = _read_range(file, max(self.out_pos[rank], size - 2000), size)
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""

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
        for file in self.files.values():
            file.close()
        shutil.rmtree(self.folder, ignore_errors=True)     # if it was never started fully
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

def raise_for(outcome: Outcome, chosen: list[int], timeout: float, *, stopped: bool,
              stopped_as: str | None = None) -> None:
    """Raise :class:`RankError` (a rank raised or died) or :class:`RankTimeout` (still busy) for a
    round's ``outcome``; ``stopped``: the group was stopped for it. ``stopped_as``: what was
    stopped, for a group that is not ``gc.ranks`` (``"the 3 ranks started for this case were
    stopped (…)"``; by default the learner is told to restart ``gc.ranks``)."""
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
            parts.append(rank_died(r, outcome.died[r], outcome.reasons.get(r, "")))
        summary = _summary(raised)
        if summary:
            parts.insert(0, summary)
        message = "; ".join(parts)
        if late:
            fate = ("could not be interrupted" if outcome.stuck
                    else "got interrupted")
            message += (f"; {who(sorted(late))} still running {PEER_GRACE:g} s later (waiting "
                        f"for the failed rank in a collective?) {fate}")
        if stopped:
            message += (". " + stopped_as[:1].upper() + stopped_as[1:] if stopped_as
                        else ". The live ranks were stopped: gc.ranks.restart() starts a fresh group")
        message += "\n" + _tracebacks(tracebacks)
        raise RankError(message.rstrip("\n"), ranks=failed, exc_types=exc_types, tracebacks=tracebacks,
                        stopped=stopped)
    if late:
        where = "".join(f"\n--- {who([r])} was here ---\n{outcome.stacks.get(r) or '(no stack)'}" for r in sorted(late))
        if stopped:
            fate = ("A rank blocked inside a collective or a recv cannot be interrupted, so "
                    + (f"{stopped_as}." if stopped_as else "the group was stopped: gc.ranks.restart() "
                       "starts a fresh one (the ranks' variables are lost)."))
        else:
            fate = "Interrupted (KeyboardInterrupt): the group is still up, its variables kept."
        others = " (the others had finished)" if len(late) < len(chosen) else ""
        positions, why = blocked_report({r: outcome.stacks[r] for r in sorted(late) if outcome.stacks.get(r)},
                                        chosen)
        blocked = positions + (f": {why}" if why else "")
        causes = ("" if why else "Usual causes: a collective that only some ranks call, a recv "
                  "with no matching send, an endless loop. ")
        raise RankTimeout(
            f"{who(sorted(late))} still busy after {timeout:g} s{others}. "
            + (f"Blocked: {blocked}. " if blocked else "") + f"{causes}{fate}{where}",
            ranks=sorted(late), stacks=dict(outcome.stacks), stopped=stopped, blocked=blocked)


def _short_paths(stack: str) -> str:
    """A stack as a learner reads it: ``torch/distributed/...`` without the install's folders, no
    thread addresses (which change every run)."""
    stack = re.sub(r"(Current thread|Thread) 0x[0-9a-fA-F]+ ", r"\1 ", stack)
    return re.sub(r'File "[^"]*[/\\](?:site|dist)-packages[/\\]', 'File "', stack)


def _summary(raised: dict[int, tuple]) -> str:
    """``"rank 1 raised KeyError: 'x'"``; ranks with the same exception line are named together."""
    by_line: dict[str, list[int]] = {}
    for r in sorted(raised):
        by_line.setdefault(exception_line(raised[r][1]) or raised[r][0], []).append(r)
    return "; ".join(f"{who(rs)} raised {line}" for line, rs in by_line.items())


def _tracebacks(tracebacks: dict[int, str]) -> str:
    """Each rank's traceback, every line labelled; identical ones once, labelled with all their ranks."""
    by_text: dict[str, list[int]] = {}
    for r in sorted(tracebacks):
        by_text.setdefault(tracebacks[r], []).append(r)
    return "".join(_labelled(who(rs), text) for text, rs in by_text.items())


def who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))


def _labelled(who: str, text: str) -> str:
    return "".join(f"[{who}] {line}\n" for line in text.splitlines())


def _read_range(file, start: int, end: int | None) -> str:
    file.seek(start)
    data = file.read() if end is None else file.read(max(0, end - start))
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
