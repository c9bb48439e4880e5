"""Live ranks (``gc.start_ranks``, ``%%ranks``) driven from this process: output in rank order,
variables kept, subsets, gather as plain data, errors, hangs, deaths, restart, cleanup, loopback.

The notebook side (the magic in a real kernel, nbval failing on a rank's error, ``kill -9`` of the
kernel) is in ``test_live_ranks_in_kernel.py``.
"""

import ipaddress
import os
import pickle
import signal
import sys
import threading
import time

import pytest
import torch
from _processes import alive, children_of, comm, listeners_of, parent_of, signal_report, wait_gone

import gpucourse as gc
from gpucourse.runtime.live_ranks import RanksInterrupted, parse_magic_line

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


@pytest.fixture(scope="module")
def group():
    """One group for the tests that leave it running (they only add variables)."""
    with gc.LiveRanks().start(2, timeout=60) as g:
        yield g


def _family(g) -> list[int]:
    """The keeper (found in /proc as the ranks' parent) and every process below it."""
    keeper = {parent_of(p) for p in g.pids}
    assert len(keeper) == 1 and comm(keeper.pop() or 0) == "gpucourse-keep"
    keeper = parent_of(g.pids[0])
    found, frontier = [keeper], [keeper]
    while frontier:
        frontier = [c for p in frontier for c in children_of(p)]
        found += frontier
    return found


# --- what a learner sees ---------------------------------------------------------------------------

def test_each_rank_output_is_complete_and_in_rank_order(group, capsys):
    group.run("import sys, time\n"
              "time.sleep(0.3 * (world_size - rank))      # rank 1 prints first\n"
              "print(f'hello from {rank}')\n"
              "print(f'warning from {rank}', file=sys.stderr)\n"
              "print(f'bye from {rank}')\n")
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["[rank 0] hello from 0", "[rank 0] bye from 0",
                                         "[rank 1] hello from 1", "[rank 1] bye from 1"]
    assert captured.err.splitlines() == ["[rank 0] warning from 0", "[rank 1] warning from 1"]


def test_a_collective_and_the_last_expression_shown_per_rank(group, capsys):
    group.run("t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nt * 10")
    assert capsys.readouterr().out.splitlines() == ["[rank 0] tensor([30.])", "[rank 1] tensor([30.])"]
    group.run("t;")                                # a trailing ';' hides the value, as in IPython
    assert capsys.readouterr().out == ""
    assert [rank_t.item() for rank_t in group.gather("t")] == [3.0, 3.0]


def test_variables_persist_and_subsets_run_only_there(group, capsys):
    group.run("count = 10 * rank")
    group.run("count += 1\nprint(count)", ranks=[1])
    assert capsys.readouterr().out == "[rank 1] 11\n"
    group.run("count += 100", ranks=0)
    assert group.gather("count") == [100, 11]
    assert group.gather("count", ranks=[1]) == [11]
    assert group.gather("(rank, world_size, int(__import__('os').environ['RANK']))") == [(0, 2, 0), (1, 2, 1)]


def test_gather_returns_plain_data(group):
    group.run("w = torch.arange(1000.0, requires_grad=True)\n"
              "y = (w * 2)[rank:rank + 2]                        # a view that needs grad\n"
              "d = {'shape': w.shape, 'n': torch.tensor(3).item(), 'name': 'w', 'dtype': w.dtype}")
    ys = group.gather("y")
    assert [y.tolist() for y in ys] == [[0.0, 2.0], [2.0, 4.0]]
    for y in ys:
        assert type(y) is torch.Tensor and not y.requires_grad and y.grad_fn is None
        assert y.untyped_storage().nbytes() == 2 * 4          # its own storage, not all of w's
    assert group.gather("d") == [{"shape": (1000,), "n": 3, "name": "w", "dtype": torch.float32}] * 2
    pickle.loads(pickle.dumps(group.gather("[y, d, None, 1.5, b'x', {1, 2}]")))
    with pytest.raises(gc.RankError, match=r"ranks 0,1 raised TypeError: gather\('torch.nn.Linear\(1, 1\)'\)"
                                           r" found a torch.nn.modules.linear.Linear"):
        group.gather("torch.nn.Linear(1, 1)")
    assert group.gather("torch.nn.Linear(1, 1).weight.shape") == [(1, 1), (1, 1)]   # the group lives on


def test_push_and_scatter_send_values_and_notebook_functions(group):
    offset = 7

    def shifted(x):                               # a closure defined here, sent by value
        return x + offset

    group.push({"shifted": shifted, "base": torch.ones(2)})
    group.scatter("mine", ["zero", "one"])
    assert group.gather("(shifted(rank), base.sum().item(), mine)") == [(7, 2.0, "zero"), (8, 2.0, "one")]
    with pytest.raises(ValueError, match="one value per rank: a list of 2"):
        group.scatter("mine", ["only one"])
    with pytest.raises(ValueError, match="identifier"):
        group.push({"not a name": 1})


def test_figures_come_back_as_png(group, capsys):
    group.run("import matplotlib.pyplot as plt\nif rank == 0:\n    plt.plot([1, 2, 3])")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[rank 0] <figure ") and "px" in lines[0]
    group.run("import matplotlib.pyplot as plt\nplt.figure(figsize=(2, 2)); plt.plot([rank]);")
    assert [line.split(" <")[0] for line in capsys.readouterr().out.splitlines()] == ["[rank 0]", "[rank 1]"]


def test_figures_the_kernel_left_open_are_not_the_ranks_to_show(capsys):
    """The ranks are forked from the kernel: a figure open there must not come back from every rank."""
    import matplotlib
    matplotlib.use("agg")
    import matplotlib.pyplot as plt
    plt.figure(figsize=(3, 3))
    plt.plot([1, 2])
    try:
        with gc.LiveRanks().start(2, timeout=60) as g:
            g.run("print('x', rank)")
        assert capsys.readouterr().out.splitlines() == ["[rank 0] x 0", "[rank 1] x 1"]
    finally:
        plt.close("all")


# --- errors fail the cell ----------------------------------------------------------------------------

def test_an_exception_on_one_rank_raises_rank_error_with_its_traceback(group, capsys):
    code = "x = 1\nif rank == 1:\n    raise KeyError('lost key')\nprint('fine', rank)"
    with pytest.raises(gc.RankError) as info:
        group.run(code)
    e = info.value
    assert (e.ranks, e.exc_types, e.stopped) == ([1], {1: "KeyError"}, False)
    lines = str(e).splitlines()
    assert lines[0] == "rank 1 raised KeyError: 'lost key'"
    assert "[rank 1]     raise KeyError('lost key')" in lines            # the cell's source line
    assert all(line.startswith("[rank 1] ") for line in lines[1:])
    assert capsys.readouterr().out == "[rank 0] fine 0\n"
    assert group.gather("x") == [1, 1]                                  # the group lives on
    again = pickle.loads(pickle.dumps(e))                               # as pytest-xdist sends it
    assert (type(again), again.ranks, str(again)) == (gc.RankError, [1], str(e))


def test_a_scripts_first_and_last_lines_in_a_cell_say_what_live_ranks_do_instead():
    # a script's last line, copied into a %%ranks cell: it "worked", and the next collective failed with
    # "Default process group has not been initialized, please make sure to call init_process_group."
    with gc.LiveRanks().start(2) as g:
        with pytest.raises(gc.RankError) as info:
            g.run("total = torch.ones(1)\ndist.all_reduce(total)\ndist.destroy_process_group()")
        first = str(info.value).splitlines()[0]
        assert first.startswith("ranks 0,1 raised RuntimeError: this cell destroyed the live ranks' process "
                                "group (dist.destroy_process_group())") and "gc.ranks.restart()" in first, first
        assert g.gather("total") == [torch.tensor([2.0])] * 2       # the cell itself ran
        g.restart()
        g.run("t = torch.ones(1)\ndist.all_reduce(t)")
        assert g.gather("t.item()") == [2.0, 2.0]
        # and a script's first lines: the group is there already
        with pytest.raises(gc.RankError) as info:
            g.run("dist.init_process_group('gloo')")
        first = str(info.value).splitlines()[0]
        assert first == ("ranks 0,1 raised ValueError: trying to initialize the default process group twice! — "
                         "live ranks start with their process group ready (gloo; `rank`, `world_size` and `dist` "
                         "are set): a %%ranks cell leaves out dist.init_process_group"), first
        assert "<ranks cell" in str(info.value)                     # the learner's line is still shown
        assert g.gather("dist.get_world_size()") == [2, 2]


def test_a_message_of_two_lines_is_named_whole_in_the_first_line(group):
    # torch's argument check writes "… of type torch.Tensor" and, indented below, "but got <class 'list'>
    # instead.": the first line said only "ranks 0,1 raised              but got <class 'list'> instead."
    with pytest.raises(gc.RankError) as info:
        group.run("dist.all_reduce([rank, 1])")
    first = str(info.value).splitlines()[0]
    assert first.startswith("ranks 0,1 raised TypeError: Invalid function argument") and \
        first.endswith("but got <class 'list'> instead."), first
    assert "  " not in first, first


def test_the_same_error_on_every_rank_is_shown_once(group):
    with pytest.raises(gc.RankError) as info:
        group.run("undefined_name + rank")
    e = info.value
    assert e.ranks == [0, 1] and e.exc_types == {0: "NameError", 1: "NameError"}
    assert str(e).splitlines()[0] == "ranks 0,1 raised NameError: name 'undefined_name' is not defined"
    assert sum(line.startswith("[ranks 0,1] Traceback") for line in str(e).splitlines()) == 1
    with pytest.raises(gc.RankError, match="SyntaxError"):
        group.run("def broken(:\n    pass")


def test_a_rank_error_while_a_peer_waits_in_a_collective_stops_the_group_quickly():
    with gc.LiveRanks().start(2) as g:
        pids = g.pids
        with pytest.raises(gc.RankError) as info:   # an hour's timeout: only the peers' grace ends it
            g.run("if rank == 1:\n    raise ValueError('bad batch')\ndist.all_reduce(torch.ones(1))", timeout=3600)
        e = info.value
        assert e.ranks == [1] and e.stopped
        assert "rank 0 still running 3 s later" in str(e) and "could not be interrupted. The live ranks were stopped" in str(e)
        assert not g.running and not wait_gone(pids, 5)
        with pytest.raises(RuntimeError, match="restart"):
            g.run("1")
        g.restart()
        assert g.gather("rank") == [0, 1]


# --- nothing hangs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("code, where, why", [
    ("if rank == 0:\n    dist.barrier()", "barrier",                    # a collective only rank 0 enters
     "rank 1 finished without calling barrier: a collective waits until every rank calls it"),
    ("if rank == 1:\n    dist.recv(torch.zeros(1), src=0)", "recv",     # recv with no sender
     "it waits for a message that no rank sends"),
])
def test_a_blocked_rank_raises_rank_timeout_naming_it_and_the_group_restarts(code, where, why):
    with gc.LiveRanks().start(2) as g:
        g.run("kept = rank")
        pids = g.pids
        blocked = 0 if where == "barrier" else 1
        with pytest.raises(gc.RankTimeout) as info:
            g.run(code, timeout=2)
        e = info.value
        assert e.ranks == [blocked] and e.stopped
        assert f"rank {blocked} still busy after 2 s (the others had finished)" in str(e)
        assert f"in {where}" in e.stacks[blocked] and "<ranks cell 2>" in e.stacks[blocked]
        assert 'File "torch/distributed/' in e.stacks[blocked] and "0x" not in e.stacks[blocked]
        source = code.splitlines()[1].strip()
        assert e.blocked == f"rank {blocked} in {where} (line 2 of <ranks cell 2>: `{source}`): {why}"
        assert f". Blocked: {e.blocked}. " in str(e).splitlines()[0]
        assert not g.running and not wait_gone(pids, 5)
        g.restart()                                          # a fresh group, variables gone
        assert g.gather("rank") == [0, 1]
        with pytest.raises(gc.RankError, match="NameError"):
            g.run("kept")


def test_a_deadlock_says_where_each_rank_waits_and_why():
    # both ranks send first: each send waits for a recv the other never reaches (gloo, 4 kB)
    with gc.LiveRanks().start(2) as g:
        g.run("def exchange(t):\n    dist.send(t, 1 - rank)\n    dist.recv(t, 1 - rank)\n    return t")
        started = time.monotonic()
        with pytest.raises(gc.RankTimeout) as info:
            g.run("exchange(torch.ones(1000))", timeout=2)
        assert time.monotonic() - started < 2 + 5
        e = info.value
        at = "(exchange, line 2 of <ranks cell 1>: `dist.send(t, 1 - rank)`)"
        assert e.blocked == (f"rank 0 in send {at}, rank 1 in send {at}: both ranks send first, and each "
                             "send waits for a recv the other rank never reaches")
        first = str(e).splitlines()[0]
        assert first.startswith(f"ranks 0,1 still busy after 2 s. Blocked: {e.blocked}. A rank blocked")
        assert "Usual causes" not in first             # the cause is known: no list of guesses


def test_a_busy_python_loop_is_interrupted_and_the_group_lives_on():
    with gc.LiveRanks().start(2) as g:
        g.run("kept = rank * 5")
        with pytest.raises(gc.RankTimeout) as info:
            g.run("import time\nwhile rank == 1:\n    time.sleep(0.01)", timeout=1)
        assert info.value.ranks == [1] and not info.value.stopped
        assert "Interrupted (KeyboardInterrupt): the group is still up" in str(info.value)
        assert g.running and g.gather("kept") == [0, 5]


@pytest.mark.parametrize("code, survives", [
    ("import time\ntime.sleep(30)", True),                        # interruptible: the group lives on
    ("if rank == 0:\n    dist.barrier()", False),                  # blocked in a collective: stopped
])
def test_ctrl_c_in_the_kernel_interrupts_the_busy_ranks(code, survives):
    # the notebook's stop button: SIGINT to the kernel, which interrupts the ranks still busy
    with gc.LiveRanks().start(2) as g:
        g.run("kept = rank")
        pids = g.pids
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        started = time.monotonic()
        try:
            g.run(code, timeout=60)
        except KeyboardInterrupt as e:             # not the sleep's end, not a RankTimeout
            # and not a bare KeyboardInterrupt: it says whether the ranks survived it
            assert isinstance(e, RanksInterrupted)
            assert str(e).startswith("ranks still live: rank" if survives else
                                     "ranks stopped — gc.ranks.restart()"), str(e)
            assert "KeyboardInterrupt" in e._render_traceback_()[0] and str(e) in e._render_traceback_()[0]
        except Exception as e:
            pytest.fail(f"{type(e).__name__}, not KeyboardInterrupt, after "
                        f"{time.monotonic() - started:.1f} s: {e}\n{signal_report(os.getpid())}")
        else:
            pytest.fail(f"no KeyboardInterrupt; the cell ended after {time.monotonic() - started:.1f} s"
                        f"\n{signal_report(os.getpid())}")
        timer.join()
        assert g.running == survives
        if survives:
            assert g.gather("kept") == [0, 1]
        else:
            assert not wait_gone(pids, 5)


def test_a_ctrl_c_the_os_hands_to_another_thread_still_interrupts_at_once():
    """The OS may deliver the kernel's SIGINT to any thread that does not block it (a kernel has
    several); Python runs the handler in the main thread only when that thread next runs bytecode.
    Waiting for the ranks in one long select, the cell heard the Ctrl-C only at its timeout."""
    with gc.LiveRanks().start(2) as g:
        done = threading.Event()
        taker = threading.Thread(target=done.wait)        # a thread that does not block SIGINT ...
        taker.start()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})   # ... and a main thread that does
        try:
            timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            started = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                g.run("import time\ntime.sleep(30)", timeout=60)
            took = time.monotonic() - started
            timer.join()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
            done.set()
            taker.join()
        assert took < 10, f"the Ctrl-C took effect after {took:.1f} s"
        assert g.running


def test_a_rank_that_dies_is_named_and_the_group_is_stopped():
    with gc.LiveRanks().start(3) as g:
        pids = g.pids
        with pytest.raises(gc.RankError) as info:
            g.run("import os, signal\nif rank == 2:\n    os.kill(os.getpid(), signal.SIGKILL)")
        e = info.value
        assert e.ranks == [2] and e.exc_types == {2: None} and e.stopped
        assert "rank 2 died with signal SIGKILL" in str(e)
        assert not wait_gone(pids, 5)


def test_a_case_on_more_ranks_that_breaks_stops_its_own_group_and_says_so_not_gc_ranks():
    """A check runs a case on 3 ranks (``resized``) beside the notebook's 2. When that case's group
    breaks, the learner is told the case's ranks were stopped — not to restart theirs, which still
    run with their variables."""
    with gc.LiveRanks().start(2) as two:
        two.run("def last_rank_dies():\n    import os\n    if rank == world_size - 1:\n        os._exit(3)\n"
                "def last_rank_waits():\n    if rank == world_size - 1:\n        dist.recv(torch.zeros(1), src=0)\n"
                "kept = rank * 7")
        pids = two.pids
        for name, error in (("last_rank_dies", gc.RankError), ("last_rank_waits", gc.RankTimeout)):
            with pytest.raises(error) as info:                   # as 04.3's and 09.3's check cells
                with two.resized(3, [name]) as three:
                    theirs = three.pids
                    three.run(f"{name}()", timeout=2)
            first = str(info.value).splitlines()[0]
            assert info.value.ranks == [2] and info.value.stopped, first
            assert "the 3 ranks started for this case were stopped (your live ranks are as they were)" \
                in first.lower(), first
            assert "restart" not in first, first
            assert not wait_gone(theirs, 5)
        # the stop button while the case's ranks are blocked in a collective: the case's group is stopped
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        with pytest.raises(RanksInterrupted) as info:
            with two.resized(3, []) as three:
                timer.start()
                three.run("if rank == 0:\n    dist.barrier()", timeout=60)
        timer.join()
        assert str(info.value) == ("ranks stopped — the 3 ranks started for this case were stopped (your live "
                                   "ranks are as they were)"), str(info.value)
        assert two.running and two.pids == pids and two.gather("kept") == [0, 7]
    # the kernel's own group, broken the same way, still says how to start a fresh one
    with gc.LiveRanks().start(3) as g:
        with pytest.raises(gc.RankError, match=r"The live ranks were stopped: gc.ranks.restart\(\) starts a fresh group"):
            g.run("import os\nif rank == 2:\n    os._exit(3)")


def test_answers_a_case_cannot_have_are_named_in_the_learners_terms_before_any_rank_starts():
    """``resized`` sends rank 0's answers by value: one the ranks never defined, or one that holds
    something pickle cannot send, is named — not shown as rank 0's traceback of the course's code."""
    with gc.LiveRanks().start(2) as two:
        two.run("import threading\nlock = threading.Lock()\n"
                "def guarded(x):\n    with lock:\n        return x\n"
                "def fine(x):\n    return x + rank")
        for names, error, says in (
                (["fine", "mean_hook"], NameError, "run your %%ranks answer cell first: the ranks do not have "
                                                   "`mean_hook`; this check runs it on 3 ranks"),
                (["fine", "guarded"], TypeError, "`guarded` cannot be sent to the 3 ranks started for this case "
                                                 "(TypeError: cannot pickle '_thread.lock' object)")):
            with pytest.raises(error) as info:
                with two.resized(3, names):
                    pytest.fail("a group was started")
            assert str(info.value).startswith(says) and "cloudpickle" not in str(info.value), str(info.value)
        assert two.gather("sorted(n for n in globals() if n.startswith('_gpucourse'))") == [[], []]
        with two.resized(3, ["fine"]) as three:                # what can be sent is, and runs as each rank's
            assert three.gather("fine(10)") == [10, 11, 12]


def test_a_name_the_kernel_has_and_the_ranks_lack_is_said_to_be_the_kernels(group):
    """A helper written in an ordinary cell lives in the kernel; a %%ranks cell that calls it meets a
    NameError on every rank — which says where the name is and the two ways to give it to the ranks."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        shell.run_cell("def helper(x):\n    return 2 * x", store_history=False)
        with pytest.raises(gc.RankError) as info:
            group.run("helper(rank)")
        first = str(info.value).splitlines()[0]
        assert first == ("ranks 0,1 raised NameError: name 'helper' is not defined (`helper` is defined in this "
                         "notebook's kernel, not on the ranks: run its cell with %%ranks as the first line, or "
                         "send it: gc.ranks.push({'helper': helper}))"), first
        group.push({"helper": shell.user_ns["helper"]})           # the way it names works
        assert group.gather("helper(rank)") == [0, 2]
        with pytest.raises(gc.RankError) as info:                  # a name the kernel lacks too: no hint
            group.run("nowhere(rank)")
        assert str(info.value).splitlines()[0] == "ranks 0,1 raised NameError: name 'nowhere' is not defined"
    finally:
        InteractiveShell.clear_instance()


def test_a_rank_gloo_aborts_is_named_with_gloos_reason_and_the_learners_line(capfd):
    """A send and its recv of different sizes: gloo aborts the receiver (SIGABRT). The error says
    why, in its first line, and where; the rank's fatal-error dump shows the learner's frames only."""
    with gc.LiveRanks().start(2) as g:
        with pytest.raises(gc.RankError) as info:
            g.run("import torch, torch.distributed as dist\n"
                  "if rank == 0:\n    dist.send(torch.arange(36.), 1)\n"
                  "else:\n    buffer = torch.zeros(18)\n    dist.recv(buffer, 0)")
        first = str(info.value).splitlines()[0]
        assert info.value.ranks == [1] and info.value.stopped
        assert first.startswith("rank 1 died (SIGABRT) in gloo: it received 144 bytes into a recv buffer of 72"), first
        assert "it was in recv (line 6 of <ranks cell" in first and "`dist.recv(buffer, 0)`" in first, first
        err = capfd.readouterr().err
        assert "[rank 1]   File \"<ranks cell" in err, err
        assert "Extension modules" not in err and "live_rank_process.py" not in err, err


# --- nothing outlives the group ----------------------------------------------------------------------

_ESCAPE = """
import subprocess
escaped = [subprocess.Popen(["sleep", "60"], start_new_session=True).pid,
           int(subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True,
                              text=True, start_new_session=True, check=True).stdout)]
"""


@linux_only
@pytest.mark.parametrize("how", ["stop", "hang", "keeper-sigterm"])
def test_stop_leaves_no_process_not_even_ones_started_in_a_new_session(how):
    g = gc.LiveRanks().start(2)
    try:
        g.run(_ESCAPE)
        escaped = [p for pair in g.gather("escaped") for p in pair]
        family = _family(g)
        assert set(g.pids) <= set(family) and len(family) >= 3
        assert all(alive(p) for p in escaped)
        if how == "hang":
            with pytest.raises(gc.RankTimeout):
                g.run("dist.barrier() if rank == 0 else None", timeout=1)
            assert not g.running
        if how == "keeper-sigterm":                         # someone ends the keeper: it cleans up
            os.kill(parent_of(g.pids[0]), signal.SIGTERM)
            assert not wait_gone(family + escaped, 5)
            with pytest.raises(gc.RankError, match="died"):
                g.run("1")
    finally:
        g.stop()
    left = wait_gone(family + escaped, 5)
    assert left == [], f"outlived the group: {[(p, comm(p)) for p in left]}"


@linux_only
def test_every_listener_of_the_group_is_on_loopback(group):
    family = _family(group)
    port = group._group.store.port                          # the store, hosted by this process
    store = [(a, p) for a, p in listeners_of([os.getpid()]) if p == port]
    theirs = listeners_of(family)                           # gloo's listeners in the ranks
    assert store == [("127.0.0.1", port)]
    assert theirs, "found no listener in the ranks: the test would prove nothing"
    public = [(a, p) for a, p in theirs if not ipaddress.ip_address(a).is_loopback]
    assert public == [], f"listening beyond loopback: {public}"
    assert group.gather("__import__('os').environ['MASTER_ADDR']") == ["127.0.0.1"] * 2


# --- the API around it -------------------------------------------------------------------------------

def test_restart_with_another_size_and_clear_errors_for_wrong_use():
    g = gc.LiveRanks()
    with pytest.raises(RuntimeError, match="never started"):
        g.run("1")
    with pytest.raises(RuntimeError, match="how many ranks"):
        g.restart()
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        g.start(0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        g.start(2, timeout=0)
    with g.start(2):
        assert not os.path.exists(g._group.folder)         # output files stay open, their folder is gone
        with pytest.raises(ValueError, match=r"rank must be <= 1 \(the group has ranks 0..1\), got 2"):
            g.run("1", ranks=[2])
        with pytest.raises(TypeError, match="code must be a str"):
            g.run(lambda: 1)
        old = g.pids
        g.restart(3)
        assert g.world_size == 3 and g.gather("world_size") == [3, 3, 3]
        assert not wait_gone(old, 5)
        assert "3 ranks running" in repr(g)
    assert not g.running and g.pids == [] and "not running" in repr(g)
    g.stop()                                               # twice is fine


def test_start_ranks_is_the_kernels_group():
    assert gc.ranks is gc.runtime.ranks
    try:
        assert gc.start_ranks(2, timeout=30) is gc.ranks
        first = gc.ranks.pids
        assert gc.start_ranks(2) is gc.ranks and not wait_gone(first, 5)   # again: fresh ranks
        assert gc.ranks.gather("rank") == [0, 1]
    finally:
        gc.ranks.stop()


@pytest.mark.parametrize("line, expected", [
    ("", (None, None)), ("0", ([0], None)), ("0,2", ([0, 2], None)), ("1 --timeout 30", ([1], 30.0)),
    ("--timeout=2.5 0,1", ([0, 1], 2.5)), ("0 2", ([0, 2], None)),
])
def test_magic_line(line, expected):
    assert parse_magic_line(line) == expected


@pytest.mark.parametrize("line, message", [
    ("--timeout", "needs a number"), ("--timeout x", "must be a number"), ("--timeout 0", "> 0"),
    ("rank0", "cannot read 'rank0' as ranks"), ("-1", "cannot read"),
])
def test_magic_line_errors(line, message):
    with pytest.raises(ValueError, match=message):
        parse_magic_line(line)


def test_interrupt_signal_in_the_kernel_never_reaches_the_ranks(group):
    # Jupyter's interrupt sends SIGINT to the kernel's whole process group: the ranks and the
    # keeper are in groups of their own, so only the kernel sees it (and interrupts busy ranks)
    pgids = {os.getpgid(p) for p in group.pids} | {os.getpgid(parent_of(group.pids[0]))}
    assert os.getpgid(0) not in pgids and len(pgids) == 3
