"""Shared test configuration: GPU-only tests skip cleanly on CPU machines."""

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    skip_multi = pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs; this machine has {n_gpu}")
    for item in items:
        if "cuda" in item.keywords and n_gpu < 1:
            item.add_marker(skip_cuda)
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)


# --- no test may leave the test process deaf to Ctrl-C ---------------------------------------------
# Several tests send SIGINT and expect a KeyboardInterrupt (in this process, or in a script it starts,
# which inherits the signal mask and ignored signals). A test that left SIGINT blocked, ignored or
# re-handled would make those fail much later, in another test; this names the test that did it and
# puts the state back.

import signal as _signal

_WATCHED = (_signal.SIGINT, _signal.SIGTERM)


def pytest_configure(config):
    """A run started with SIGINT ignored (``make test &`` from a script, ``nohup``, a CI runner that
    starts its steps in the background) hands the ignore down to every process a test starts: Python
    then installs no KeyboardInterrupt handler in them, and each Ctrl-C test waited out its timeout and
    failed (9 failures and 2 errors, 30-60 s each, measured 2026-12-07). Such a run is not in the
    terminal's foreground, so no keyboard reaches it: hear SIGINT as an interactive Python would
    (here, in each xdist worker, and so in every process they start)."""
    if _signal.getsignal(_signal.SIGINT) is _signal.SIG_IGN:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [_signal.SIGINT])


def _signal_state():
    return ({s: _signal.getsignal(s) for s in _WATCHED},
            frozenset(_signal.pthread_sigmask(_signal.SIG_BLOCK, [])))


_BEFORE = pytest.StashKey[tuple]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_BEFORE] = _signal_state()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    before, after = item.stash.get(_BEFORE, None), _signal_state()
    if before is not None and after != before:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, before[1])
        for s, handler in before[0].items():
            _signal.signal(s, handler)
        changed = [f"{_signal.Signals(s).name} handler {before[0][s]!r} -> {after[0][s]!r}"
                   for s in _WATCHED if before[0][s] != after[0][s]]
        if before[1] != after[1]:
            changed.append(f"blocked signals {sorted(int(s) for s in before[1])} -> "
                           f"{sorted(int(s) for s in after[1])}")
        raise AssertionError(f"the test left the test process's signals changed ({'; '.join(changed)});"
                             " they were put back")
    return result
