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
   a collective. Meanwhile a ``%%ranks`` cell in a notebook shows a line per rank (running, done,
   its last print), updated in place and cleared when the cell ends (:class:`_LiveLines`);
3) ranks still busy at the deadline: ask each where it is (a Python stack), then interrupt it
   (``KeyboardInterrupt``). A rank stuck inside a collective cannot be interrupted — then the group
   is broken, and it is stopped: :meth:`LiveRanks.restart` starts a fresh one in well under 5 s.
   The error names where each rank waits ("rank 0 in send (line 2 of <ranks cell 4>: …)") and a
   known pattern's cause ("both ranks send first"). The notebook's stop button interrupts the busy
   ranks too, and says whether the group survived ("ranks still live" / "ranks stopped");
4) show each rank's output in rank order, all of it before the next rank's, lines labelled
   ``[rank r]``: stdout, stderr, then its figures — the same every run, so nbval can compare it;
5) raise :class:`RankError` (a rank raised or died; its traceback, rank-labelled) or
   :class:`RankTimeout` (the ranks still busy and where they were), so the cell fails — and a
   notebook under nbval or ``make test`` with it.

**Why forked processes, not one Jupyter kernel per rank.** The targets are a start-up of at most
4 s for 2 ranks and 7 s for 4 on 2 cores, and a trivial cell's round trip of at most 50 ms. One
ipykernel per rank, started through ``jupyter_client``, took ~5.7 s for 2 ranks and ~8.7 s for 4
(each kernel imports torch on its own) before any cell ran. So the ranks are forks of the
notebook's kernel, which has torch imported already, started with the pieces ``gc.launch`` is
tested with (the loopback store, the rank's process setup, the process-tree cleanup), and they
talk to the kernel over pipes: about 1 s for the first start in a kernel (most of it importing
``torch._dynamo`` once, which DDP and every optimizer need), about 0.3 s for a restart, well under
a millisecond per trivial cell plus the kernel's own ~10 ms (``benchmarks/live_ranks.py``). What a
kernel per rank would add — rich output — the ranks do for what the lessons need: the last
expression's ``repr``, ``print``, and matplotlib figures (drawn with Agg in the rank, shown in the
notebook as PNG). Tracebacks carry the cell's source lines.

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

import ast
import contextlib
import linecache
import os
import pickle
import re
import weakref
from collections.abc import Iterable
from typing import Any

from .live_group import LiveGroup, Outcome, RankError, RankTimeout, raise_for, who
from .live_rank_process import CELL_PREFIX
from .processes import warm_parent
from .validate import check_int, check_positive

__all__ = ["LiveRanks", "RankError", "RankTimeout", "RanksInterrupted", "checking", "ranks", "start_ranks"]

_INTERRUPT_GRACE = 1.0   # s an interrupted rank gets to return to its loop before the group is stopped
_checking = False        # a check is running its cases: code it sends is "<ranks check N>", not the learner's


class RanksInterrupted(KeyboardInterrupt):
    """The notebook's stop button during a live-ranks cell; says whether the ranks survived it."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31mKeyboardInterrupt\x1b[0m: {self}"]


@contextlib.contextmanager
def checking():
    """While a check runs its cases: the code it sends the ranks is the check's (``<ranks check N>``
    in tracebacks), and a rank's error names the learner's line and a lost ``%%ranks`` answer."""
    global _checking
    before, _checking = _checking, True
    try:
        yield
    finally:
        _checking = before


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
        self._group: LiveGroup | None = None
        self._why_stopped = "they were never started: call gc.start_ranks(n) first"
        self._cells = 0
        self._last_world_size: int | None = None
        self.timeout = 60.0
        #: live lines (running / done / last print) while a %%ranks cell runs: None decides by the
        #: frontend (a notebook that names its cells), True or False always or never
        self.progress: bool | None = None
        self._defined: set[str] = set()     # names the cells run on these ranks bound (def, class, =)
        self._lost: set[str] = set()        # names earlier groups had that these ranks were never given
        self._stopped_as: str | None = None  # a case's group (resized): what its errors say was stopped

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
        self._group = LiveGroup.start(world_size, timeout)
        self._lost, self._defined = self._lost | self._defined, set()   # what the old ranks had
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

    @contextlib.contextmanager
    def resized(self, world_size: int, names: Iterable[str]):
        """Ranks of ``world_size`` that have this group's ``names`` (what a ``%%ranks`` answer
        defined): this group itself when it has that many ranks, else a group of its own, started
        for the ``with`` block and stopped after it. This group is left as it is either way — its
        ranks, their variables — so a check can run a case on 3 ranks while the notebook keeps its 2.

        The values travel from this group's rank 0 by value (cloudpickle: a function with the
        functions and values it uses); a function's ``rank`` and ``world_size`` are then each new
        rank's own, not rank 0's. Starting 3 ranks costs about 0.3 s once a kernel has started some.

        Example::

            >>> with LiveRanks().start(2) as two:
            ...     two.run("def whoami():\\n    return rank, world_size")
            ...     with two.resized(3, ["whoami"]) as three:
            ...         print(three.gather("whoami()"), two.gather("whoami()"))
            [(0, 3), (1, 3), (2, 3)] [(0, 2), (1, 2)]
        """
        check_int("world_size", world_size, 1)
        names = list(_names(dict.fromkeys(names)))
        if self.world_size == world_size:
            yield self
            return
        self._run(_PACK_ANSWERS + f"_gpucourse_answers = _gpucourse_pack({names!r})\ndel _gpucourse_pack",
                  0, None, live=False)
        how, packed = self.gather("_gpucourse_answers", ranks=0)[0]
        self.run("del _gpucourse_answers", ranks=0)
        if how != "ok":                    # said in the learner's terms, not as rank 0's traceback of this code
            raise _answers_not_sent(how, packed, world_size, self._lost)
        group = LiveRanks()
        group._cells, group._lost = self._cells, self._lost     # cell names stay unique in linecache
        # what its errors say was stopped: the case's group, not gc.ranks (no restart to ask for)
        group._stopped_as = f"the {world_size} ranks started for this case were stopped (your live ranks are as they were)"
        try:
            group.start(world_size, timeout=self.timeout)
            group.push({"_gpucourse_answers": packed})
            group._run(_LOAD_ANSWERS, None, None, live=False)
            yield group
        finally:
            self._cells = max(self._cells, group._cells)
            group.stop()

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
        self._run(code, ranks, timeout, live=False)

    def _run(self, code: str, ranks, timeout: float | None, *, live: bool) -> None:
        __tracebackhide__ = True  # IPython leaves this frame out of the traceback it shows
        if not isinstance(code, str):
            raise TypeError(f"code must be a str of Python source, got {type(code).__name__}")
        self._cells += 1
        filename = f"{CELL_PREFIX}{'check' if _checking else 'cell'} {self._cells}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # for reports here
        chosen = self._chosen(ranks)
        try:
            self._round({r: ("exec", code, filename) for r in chosen}, timeout, live=live)
        except RankError as e:
            if _checking:
                _explain_for_a_check(e, self._lost)
            _name_only_in_the_kernel(e)
            raise
        if not _checking:
            self._defined |= _bound_names(code)

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
    def _round(self, messages: dict[int, tuple], timeout: float | None, *, live: bool = False) -> dict[int, Any]:
        """Send each rank its message; wait; show the output in rank order; return values or raise."""
        __tracebackhide__ = True  # IPython leaves this frame out of the traceback it shows
        group = self._live()
        timeout = self.timeout if timeout is None else check_positive("timeout", timeout)
        # 1) send; 2) wait (a %%ranks cell in a notebook: a live line per rank meanwhile)
        lines = _LiveLines(group, sorted(messages)) if live and self._shows_progress() else None
        try:
            outcome = group.exchange(messages, timeout, progress=lines)
        finally:
            if lines is not None:
                lines.close()
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
            raise RanksInterrupted(
                (f"ranks stopped — {self._stopped_as}" if self._stopped_as else
                 "ranks stopped — gc.ranks.restart() starts a fresh group (the ranks' variables are lost)")
                if broken else f"ranks still live: {who(outcome.late or sorted(messages))} interrupted, the "
                               "group is up and keeps its variables")
        # 5) errors fail the cell
        raise_for(outcome, sorted(messages), timeout, stopped=broken, stopped_as=self._stopped_as)
        return {r: reply[3] for r, reply in outcome.replies.items()}

    def _shows_progress(self) -> bool:
        """Live lines while a ``%%ranks`` cell runs: ``progress`` True/False, or None (the default):
        only in a notebook frontend that names its cells (JupyterLab, Notebook 7, VS Code) — not
        under nbval or nbclient, which keep every output, so a stored notebook's outputs stay the same."""
        if self.progress is not None:
            return bool(self.progress)
        try:
            from IPython import get_ipython
        except ImportError:
            return False
        shell = get_ipython()
        kernel = getattr(shell, "kernel", None)
        try:
            parent = kernel.get_parent("shell") if kernel is not None else {}
        except Exception:  # noqa: BLE001 - an older ipykernel: no live lines
            return False
        return bool((parent or {}).get("metadata", {}).get("cellId"))

    def _broken(self, outcome: Outcome) -> None:
        if outcome.died:
            why = f"{who(sorted(outcome.died))} died"
        else:
            why = f"{who(outcome.stuck)} stayed blocked (a collective or a recv cannot be interrupted)"
        self.stop()
        self._why_stopped = (f"{why} in an earlier cell, so the group was stopped: gc.ranks.restart() "
                             "starts a fresh one (the ranks' variables are lost)")

    def _live(self) -> LiveGroup:
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


#: run on this group's rank 0 by :meth:`LiveRanks.resized`: the answers pickled by value, or what stops it
_PACK_ANSWERS = """
def _gpucourse_pack(names):
    import cloudpickle
    missing = [name for name in names if name not in globals()]
    if missing:
        return "missing", missing
    try:
        return "ok", cloudpickle.dumps({name: globals()[name] for name in names})
    except Exception:
        for name in names:
            try:
                cloudpickle.dumps(globals()[name])
            except Exception as e:
                return "unpicklable", (name, f"{type(e).__name__}: {e}")
        raise


"""


def _undefined_name(error: RankError) -> str | None:
    """The name of a NameError every failed rank raised (named in the error's first line), else None."""
    if set(error.exc_types.values()) != {"NameError"}:
        return None
    found = re.search(r"NameError: name '(\w+)' is not defined", str(error).partition("\n")[0])
    return found[1] if found else None


def _run_the_answer_cell(names: list[str], lost: set[str]) -> str:
    """What a check says of answers the ranks do not have (restarted ranks lost them, or never had them)."""
    listed = ", ".join(f"`{n}`" for n in names)
    if set(names) & lost:
        return f"run your %%ranks answer cell again: the new ranks do not have {listed} (gc.ranks was restarted)"
    return f"run your %%ranks answer cell first: the ranks do not have {listed}"


def _name_only_in_the_kernel(error: RankError) -> None:
    """Add to the first line of a NameError on the ranks that the kernel has that name (see
    :func:`_only_in_the_kernel`)."""
    name = _undefined_name(error)
    hint = _only_in_the_kernel([name]) if name else ""
    if hint:
        first, newline, rest = str(error).partition("\n")
        error.args = (first + hint + newline + rest,)


def _only_in_the_kernel(names) -> str:
    """`` (it is defined in this notebook's kernel, …)`` for the names the ranks lack that the
    kernel has: an answer written in an ordinary cell, which runs in the kernel, not on the ranks."""
    try:
        from IPython import get_ipython
    except ImportError:
        return ""
    shell = get_ipython()
    theirs = [n for n in names if shell is not None and n in shell.user_ns]
    if not theirs:
        return ""
    listed = ", ".join(f"`{n}`" for n in theirs)
    one = len(theirs) == 1
    return (f" ({listed} {'is' if one else 'are'} defined in this notebook's kernel, not on the ranks: run "
            f"{'its cell' if one else 'their cells'} with %%ranks as the first line, or send "
            f"{'it' if one else 'them'}: gc.ranks.push({{{', '.join(f'{n!r}: {n}' for n in theirs)}}}))")


def _answers_not_sent(how: str, detail, world_size: int, lost: set[str]) -> Exception:
    """Why :meth:`LiveRanks.resized` cannot give a case's ranks the learner's answers."""
    if how == "missing":               # the same words as a check's NameError on the live ranks themselves
        return NameError(f"{_run_the_answer_cell(detail, lost)}{_only_in_the_kernel(detail)}; this check "
                         f"runs it on {world_size} ranks")
    name, error = detail
    return TypeError(f"`{name}` cannot be sent to the {world_size} ranks started for this case ({error}): "
                     "it holds, or uses as a global, something that cannot be pickled (a lock, a file, a "
                     "connection, a process group); create that inside the function instead")


#: run on the ranks :meth:`LiveRanks.resized` started: bind the answers from the other group's rank 0,
#: their functions seeing this rank's ``rank``, ``world_size`` (cloudpickle gave them rank 0's)
_LOAD_ANSWERS = """
def _gpucourse_load(blob, namespace):
    import cloudpickle
    answers = cloudpickle.loads(blob)
    own = {name: namespace[name] for name in ("rank", "world_size", "dist", "torch")}
    for value in answers.values():
        captured = getattr(value, "__globals__", None)
        if isinstance(captured, dict) and captured is not namespace:
            captured.update(own)
    namespace.update(answers)


_gpucourse_load(_gpucourse_answers, globals())
del _gpucourse_load, _gpucourse_answers
"""


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
    ranks._run(cell, chosen, timeout, live=True)


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


class _LiveLines:
    """A line per rank while a ``%%ranks`` cell runs — running (how long, its last print), done,
    raised, died — in one display that is updated in place, and cleared when the cell ends (the
    ordered, rank-by-rank output takes its place)."""

    DELAY = 0.5      # s before the first line shows: a quick cell shows nothing but its output

    def __init__(self, group: LiveGroup, chosen: list[int]):
        import time

        self.group, self.chosen, self.clock = group, chosen, time.monotonic
        self.started, self.handle, self.text = self.clock(), None, ""

    def __call__(self, busy, outcome: Outcome) -> None:
        elapsed = self.clock() - self.started
        if elapsed < self.DELAY:
            return
        lines = []
        for r in self.chosen:
            reply = outcome.replies.get(r)
            if r in outcome.died:
                state = "died"
            elif reply is not None:
                state = f"raised {reply[2][0]}" if reply[2] is not None else "done"
            else:
                state = f"running {elapsed:.0f} s"
            last = self.group.last_line(r)
            lines.append(f"[rank {r}] {state}" + (f" · last print: {last[:100]}" if last else ""))
        text = "\n".join(lines)
        if text == self.text:
            return
        from IPython.display import display

        self.text = text
        if self.handle is None:
            self.handle = display({"text/plain": text}, raw=True, display_id=True)
        else:
            self.handle.update({"text/plain": text}, raw=True)

    def close(self) -> None:
        if self.handle is not None:
            from IPython.display import clear_output

            clear_output()            # the magic's cell had no other output yet


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


# --- errors of a check's code on the ranks, as a learner reads them ------------------------------------

_TB_FRAME = re.compile(r'^\[ranks? [\d,]+\]   File "(?P<path><ranks [^"]*)", line (?P<line>\d+), in (?P<func>\S+)')


def _bound_names(code: str) -> set[str]:
    """The names a cell binds at its top level (functions, classes, assignments, imports)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _explain_for_a_check(error: RankError, lost: set[str]) -> None:
    """Rewrite the first line of a rank's error in a check's code: which line of the learner's
    ``%%ranks`` cell raised it, or which answer the ranks do not have (restarted ranks lose them)."""
    text = str(error)
    first, _, rest = text.partition("\n")
    frames = [m for m in map(_TB_FRAME.match, rest.splitlines()) if m]
    theirs = [m for m in frames if not m["path"].startswith(f"{CELL_PREFIX}check")]
    missing = None if theirs else _undefined_name(error)
    if missing:
        first = f"{first} — {_run_the_answer_cell([missing], lost)}"
    elif theirs:
        last = theirs[-1]                         # the innermost frame of the learner's code
        source = linecache.getline(last["path"], int(last["line"])).strip()
        func = f" (in {last['func']})" if last["func"] != "<module>" else ""
        first = (f"{first} — at line {last['line']} of your %%ranks cell {last['path']}{func}"
                 + (f": `{source[:100]}`" if source else ""))
    hint = _known_torch_message(text)
    if hint:
        first = f"{first} ({hint})"
    error.args = (f"{first}\n{rest}" if rest else first,)


def _known_torch_message(text: str) -> str:
    """A learner's reading of PyTorch's internal messages that a wrong answer provokes."""
    if "expected the hook result is a PyObject" in text:
        return ("a communication hook's future must hold one tensor: this one held something else, "
                "e.g. the list work.get_future() gives — take its [0] with .then(...)")
    return ""
