"""gc.runtime.run_main: a torchrun script's last line keeps main's status, reports errors, flushes."""

import subprocess
import sys
import textwrap

import pytest


def _run(body):
    code = textwrap.dedent("""
        import sys
        import gpucourse as gc
        def main():
        """) + textwrap.indent(textwrap.dedent(body), "    ") + "\ngc.runtime.run_main(main)\nprint('not reached')\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("body, status", [
    ("print('done', end='')", 0),              # unflushed output still arrives: flushed before os._exit
    ("print('done', end=''); return 3", 3),
    ("print('done', end=''); sys.exit(4)", 4),
    ("print('done', end=''); return {'losses': [1.0]}", 0),     # a main that returns its results
])
def test_status_and_output(body, status):
    r = _run(body)
    assert (r.returncode, r.stdout) == (status, "done")


def test_sys_exit_with_a_message_prints_it_and_exits_1():
    r = _run("sys.exit('no data here')")
    assert r.returncode == 1 and "no data here" in r.stderr


def test_an_exception_is_reported_and_exits_1():
    r = _run("raise ValueError('boom 42')")
    assert r.returncode == 1
    assert "ValueError: boom 42" in r.stderr and "not reached" not in r.stdout


def test_the_process_group_is_destroyed_first(tmp_path):
    r = _run(f"""
        import os, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(gc.free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        import atexit
        atexit.register(lambda: open({str(tmp_path / 'atexit')!r}, "w").close())   # skipped by os._exit
        import gpucourse.runtime.exiting as ex
        real = dist.destroy_process_group
        def spy():
            print("destroyed", end="")
            real()
        dist.destroy_process_group = spy
        """)
    assert (r.returncode, r.stdout) == (0, "destroyed"), r.stderr
    assert not (tmp_path / "atexit").exists()
