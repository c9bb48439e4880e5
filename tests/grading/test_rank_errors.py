"""Errors and hangs on the ranks, as the learner reads them in a check's verdict (issue 38).

A tiny chapter 99 whose exercises run on ranks — 99.1 on the live ranks (a ``%%ranks`` answer, a
check that sends it its cases), 99.2 with ``gc.launch`` — is judged the way ``grade`` does it
(:mod:`_mutations`: the judge in its own process, the learner's cells in this process's IPython
shell, their ``%%ranks`` cells on this process's live ranks), with wrong answers planted:

- a typo on the ranks names the rank, the exception and the line of the learner's ``%%ranks`` cell;
- after ``gc.ranks.restart()`` the check says to run the ``%%ranks`` answer cell again;
- a deadlock (both ranks send first) ends the check at its first case, within one case's timeout,
  naming where each rank waits; with ``gc.launch`` too, where each case used to wait its timeout.

Then the course's own live-rank exercises (00.4, 04.5, 09.6) with the failures the issue lists.
"""

from __future__ import annotations

import contextlib
import io
import json
import time

import _mutations
import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

import gpucourse as gc
from gpucourse.grading import harness
from gpucourse.grading.exercises import BEGIN, END

TIMEOUT = 3          # s: each case's timeout in the tiny chapter's checks

SWAP = f"""%%ranks
def swap(t):
    {BEGIN}
    other = torch.empty_like(t)
    if rank == 0:
        dist.send(t, 1)
        dist.recv(other, 1)
    else:
        dist.recv(other, 0)
        dist.send(t, 0)
    return other
    {END}"""

CASES = """def cases(rng):
    for n in (1000, 2000, 3000):
        yield (rng.randn(n),)
"""   # every check's cases: three tensors

SWAP_CHECK = f"""# Check 99.1 — swap on the live ranks
{CASES}

def on_live_ranks(t):
    gc.ranks.push({{"check_t": t}})
    gc.ranks.run("check_result = swap(check_t.clone() + rank)", timeout={TIMEOUT})
    return gc.ranks.gather("check_result")


gc.check_exercise("99.1", on_live_ranks, cases)"""

EXCHANGE = f"""def exchange(t):
    {BEGIN}
    other, rank = torch.empty_like(t), dist.get_rank()
    if rank == 0:
        dist.send(t, 1)
        dist.recv(other, 1)
    else:
        dist.recv(other, 0)
        dist.send(t, 0)
    return other
    {END}"""

EXCHANGE_CHECK = f"""# Check 99.2 — exchange on two launched ranks
{CASES}

def launched(t):
    def worker(rank, world_size):
        return exchange(t.clone() + rank)
    return gc.launch(worker, 2, timeout={TIMEOUT})


gc.check_exercise("99.2", launched, cases)"""

PASS_ALONG = EXCHANGE.replace("def exchange(t):", "def pass_along(t):")

RECORDED_CHECK = f"""# Check 99.3 — pass_along on two launched ranks, its messages recorded
{CASES}

def recorded(t):
    def worker(rank, world_size):
        saved, sizes = {{name: getattr(dist, name) for name in ("send", "recv")}}, []

        def noted(real):
            def call(tensor, *args, **kwargs):
                sizes.append(tensor.numel())
                return real(tensor, *args, **kwargs)
            return call

        try:
            for name, real in saved.items():
                setattr(dist, name, noted(real))
            return pass_along(t.clone() + rank), sizes
        finally:
            for name, real in saved.items():
                setattr(dist, name, real)
    return gc.launch(worker, 2, timeout={TIMEOUT})


gc.check_exercise("99.3", recorded, cases)"""

SWAP_COUNTED = SWAP.replace("def swap(t):", "def swap_counted(t):")

COUNTED_CHECK = f'''# Check 99.4 — swap_counted on the live ranks, its calls counted
{CASES}

ON_EACH_RANK = """
originals, calls = {{name: getattr(dist, name) for name in ("send", "recv")}}, []


def counted(name):
    def call(*args, **kwargs):
        calls.append(name)
        return originals[name](*args, **kwargs)
    return call


for name in originals:
    setattr(dist, name, counted(name))
try:
    check_result = swap_counted(check_t.clone() + rank)
finally:
    for name, f in originals.items():
        setattr(dist, name, f)
"""


def on_live_ranks(t):
    gc.ranks.push({{"check_t": t}})
    gc.ranks.run(ON_EACH_RANK, timeout={TIMEOUT})
    return gc.ranks.gather("check_result"), gc.ranks.gather("calls")


gc.check_exercise("99.4", on_live_ranks, cases)'''

BOTH_SEND_FIRST = """other = torch.empty_like(t)
peer = 1 - dist.get_rank()
dist.send(t, peer)
dist.recv(other, peer)
return other"""


@pytest.fixture(scope="module")
def tiny_solutions(tmp_path_factory):
    sol = tmp_path_factory.mktemp("ranks") / "solutions"
    sol.mkdir()
    nb = new_notebook(cells=[
        new_markdown_cell("# 99 · ranks"),
        new_code_cell("import gpucourse as gc\nimport torch\nimport torch.distributed as dist"),
        new_markdown_cell("## Exercise 99.1 — swap on live ranks"),
        new_code_cell("gc.start_ranks(2)"),
        new_code_cell(SWAP),
        new_code_cell(SWAP_CHECK, metadata={"tags": ["check"]}),
        new_markdown_cell("## Exercise 99.2 — exchange on launched ranks"),
        new_code_cell(EXCHANGE),
        new_code_cell(EXCHANGE_CHECK, metadata={"tags": ["check"]}),
        new_markdown_cell("## Exercise 99.3 — pass_along, its messages recorded by the check"),
        new_code_cell(PASS_ALONG),
        new_code_cell(RECORDED_CHECK, metadata={"tags": ["check"]}),
        new_markdown_cell("## Exercise 99.4 — swap_counted, its calls counted by the check"),
        new_code_cell(SWAP_COUNTED),
        new_code_cell(COUNTED_CHECK, metadata={"tags": ["check"]}),
    ])
    nbformat.write(nb, sol / "99_ranks_exercises.ipynb")
    yield sol
    judge = _mutations._judges.pop("99", None)
    if judge is not None:
        judge.process.close()


@pytest.fixture
def chapter(tiny_solutions, monkeypatch):
    """The tiny chapter 99 as the solutions the mutation machinery reads (its judge kept for the module)."""
    monkeypatch.setattr(_mutations, "SOLUTIONS", tiny_solutions)


def judged(chapter: str, exercise: str, answer, *, before_check=None, seed: int = 11) -> tuple[float, dict]:
    """``(seconds the check cell took, the judge's verdict)`` for one planted answer; ``before_check``
    runs between the notebook's cells and the check (a learner restarting the ranks)."""
    judge = _mutations.judge_of(chapter)
    mode = harness._state["mode"]
    try:
        _, check = _mutations._student_namespace(chapter, exercise, None if answer is None else [answer])
        if before_check is not None:
            before_check()
        harness._state["mode"] = "graded"
        harness.prime(exercise, json.dumps(judge.cases(exercise, seed)))
        started = time.monotonic()
        with contextlib.redirect_stdout(io.StringIO()):
            _mutations._run(_mutations._shell(), check, f"check {exercise}")
        took = time.monotonic() - started
        return took, judge.compare(exercise, seed, harness.collect())
    finally:
        harness._state["mode"] = mode
        harness._state["runs"].pop(exercise, None)
        if (ranks := _mutations._live_ranks()) is not None:
            ranks.stop()
        from IPython.core.interactiveshell import InteractiveShell

        InteractiveShell.clear_instance()


def _first_line(verdict: dict) -> str:
    assert not verdict["passed"], "the wrong answer passed"
    message = verdict["message"]
    assert "cannot unpack" not in message and "Raised(" not in message and "\\n" not in message, message
    return message.splitlines()[0]


def test_the_tiny_chapter_passes_its_own_answers(chapter):
    for exercise in ("99.1", "99.2", "99.3", "99.4"):
        _, verdict = judged("99", exercise, None)
        assert verdict["passed"], verdict["message"]


def test_a_typo_names_the_rank_the_exception_and_the_learners_line(chapter):
    typo = "other = torch.empty_like(t)\nother.copy_(t)\nreturn othr"
    first = _first_line(judged("99", "99.1", typo)[1])
    assert "ranks 0,1 raised NameError: name 'othr' is not defined" in first, first
    assert "line 4 of your %%ranks cell" in first and "(in swap): `return othr`" in first, first


def test_after_a_restart_the_check_asks_for_the_ranks_cell_again(chapter):
    first = _first_line(judged("99", "99.1", None, before_check=lambda: gc.ranks.restart())[1])
    assert "run your %%ranks answer cell again: the new ranks do not have `swap`" in first, first


@pytest.mark.parametrize("exercise, where", [
    ("99.1", "swap, line 4 of <ranks cell"),   # the live ranks: the %%ranks cell's line
    ("99.2", "exchange, line 4"),          # gc.launch: the notebook cell's line
    # the check wraps dist.send to record the messages: the learner's line, not the wrapper's
    ("99.3", "pass_along, line 4"),        # gc.launch, the wrapper in the check's cell
    ("99.4", "swap_counted, line 4 of <ranks cell"),   # live ranks, the wrapper in <ranks check N>
])
def test_a_deadlock_ends_the_check_within_one_case_naming_where_each_rank_waits(chapter, exercise, where):
    took, verdict = judged("99", exercise, BOTH_SEND_FIRST)
    first = _first_line(verdict)
    assert took < TIMEOUT + 4, f"the check took {took:.1f} s: each case waited its {TIMEOUT} s timeout?"
    assert "case 1 of 3" in first, first
    for rank in (0, 1):
        assert f"rank {rank} in send ({where}" in first and "`dist.send(t, peer)`" in first, first
    assert "both ranks send first" in first and "The check stopped at this case" in first, first


# --- the course's own live-rank exercises --------------------------------------------------------------

COURSE = [
    ("00", "00.4", "typo", """share = values.tensor_split(world_size)[rank].sum()
totl = share.clone()
dist.all_reduce(total)
return share, total""", None,
     ["ranks 0,1,2 raised NameError: name 'total' is not defined", "of your %%ranks cell",
      "(in share_and_total): `dist.all_reduce(total)`"]),
    ("04", "04.5", "allreduce_hook", """from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
return allreduce_hook(state, bucket)""", None,
     ["allreduce_hook is off limits here", "(in mean_hook): `return allreduce_hook(state, bucket)`"]),
    ("04", "04.5", "a future of a list", """buffer = bucket.buffer()
buffer.div_(dist.get_world_size())
return dist.all_reduce(buffer, async_op=True).get_future()""", None,
     ["a communication hook's future must hold one tensor"]),
    ("04", "04.5", "restarted", None, "restart",
     ["run your %%ranks answer cell again: the new ranks do not have `mean_hook`"]),
    # the answer's cell run without its %%ranks line: the function is the kernel's, the ranks lack it
    ("00", "00.4", "in the kernel", None, "share_and_total",
     ["ranks do not have `share_and_total`", "(`share_and_total` is defined in this notebook's kernel, "
      "not on the ranks: run its cell with %%ranks as the first line, or send it: "
      "gc.ranks.push({'share_and_total': share_and_total}))"]),
    ("04", "04.5", "in the kernel", None, "mean_hook",       # its first case runs on 3 ranks (resized)
     ["ranks do not have `mean_hook`", "(`mean_hook` is defined in this notebook's kernel, not on the "
      "ranks: run its cell with %%ranks as the first line, or send it: gc.ranks.push({'mean_hook': mean_hook}))"]),
    ("09", "09.6", "typo", """mine = torch.arange(w.shape[1]).tensor_split(world_size)[rank]
partial = x[:, mine] @ w[:, mine].T
dist.all_reduce(partial)
return partial, y + b""", None,
     ["ranks 0,1 raised NameError: name 'y' is not defined", "(in row_parallel_output): `return partial, y + b`"]),
]


@pytest.mark.parametrize("chapter_, exercise, kind, answer, before, says", COURSE,
                         ids=[f"{c[1]}-{c[2]}" for c in COURSE])
def test_the_course_live_rank_checks_say_what_went_wrong(chapter_, exercise, kind, answer, before, says):
    def in_the_kernel():                   # what running the answer's cell without %%ranks leaves
        _mutations._shell().user_ns[before] = lambda *args: None
        gc.ranks.run(f"del {before}")

    restart = (lambda: gc.ranks.restart()) if before == "restart" else in_the_kernel if before else None
    first = _first_line(judged(chapter_, exercise, answer, before_check=restart)[1])
    for text in says:
        assert text in first, first
