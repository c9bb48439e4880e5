"""checked_init_process_group and parse_init_method: good configurations work, bad ones fail fast."""

import datetime
import os
import pathlib
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import gpucourse as gc
from gpucourse.cluster.rendezvous import _fresh_key_count

import _launch_targets

# --- parse_init_method -------------------------------------------------------------------------


@pytest.mark.parametrize("url, expected", [
    ("tcp://10.1.1.20:23456", gc.InitMethod("tcp", "10.1.1.20", 23456)),
    ("TCP://node01:29500/", gc.InitMethod("tcp", "node01", 29500)),
    ("tcp://[::1]:29500", gc.InitMethod("tcp", "::1", 29500)),
    ("file:///mnt/nfs/sharedfile", gc.InitMethod("file", path="/mnt/nfs/sharedfile")),
    ("env://", gc.InitMethod("env")),
])
def test_parse_good_urls(url, expected):
    parsed = gc.parse_init_method(url)
    assert parsed == expected
    assert gc.parse_init_method(parsed.url) == parsed


@pytest.mark.parametrize("url, msg", [
    ("tcp://10.1.1.20", "has no port"),
    ("tcp://10.1.1.20:abc", "'abc' is not a number"),
    ("tcp://10.1.1.20:99999", "not a number in 1-65535"),
    ("tcp://10.1.1.20:0", "port 0"),
    ("tcp://:29500", "has no host"),
    ("tcp:/10.1.1.20:23456", "is not a URL; it needs '//'"),
    ("10.1.1.20:23456", "is not a URL"),
    ("http://10.1.1.20:23456", "scheme 'http'"),
    ("file://relative/path", "three slashes"),
    ("file:///tmp/dir/", "absolute path"),
    ("env://10.0.0.1:29500", "env:// takes no address"),
    ("tcp://h:1/path", "takes only host:port"),
])
def test_parse_bad_urls_name_the_problem(url, msg):
    with pytest.raises(ValueError, match=msg):
        gc.parse_init_method(url)


def test_parse_rejects_non_strings():
    with pytest.raises(TypeError, match="init_method must be a str"):
        gc.parse_init_method(29500)


@pytest.mark.parametrize("kind", ["tcp", "file"])
def test_urls_we_accept_are_accepted_by_torch(kind, tmp_path):
    """Oracle: torch's own init_process_group joins a 1-process group with the same URL."""
    url = (f"tcp://127.0.0.1:{gc.free_port()}" if kind == "tcp" else f"file://{tmp_path}/init")
    gc.parse_init_method(url)

    def join(rank, world_size):
        dist.init_process_group("gloo", init_method=url, rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=10))
        dist.destroy_process_group()
        return True

    assert gc.launch(join, 1, init_process_group=False, timeout=30) == [True]


# --- checked_init_process_group: successful rendezvous -------------------------------------------


def _join_and_sum(rank, world_size, url, claimed_rank=None, claimed_world=None, destroy=True,
                  join_timeout=10.0):
    r = rank if claimed_rank is None else claimed_rank[rank]
    ws = world_size if claimed_world is None else claimed_world
    gc.checked_init_process_group("gloo", url, rank=r, world_size=ws, timeout=10,
                                  join_timeout=join_timeout)
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t)
    if destroy:
        dist.destroy_process_group()
    return t.item()


@pytest.mark.parametrize("n", [2, 3])
def test_tcp_rendezvous_then_all_reduce(n):
    url = f"tcp://127.0.0.1:{gc.free_port()}"
    assert gc.launch(_join_and_sum, n, args=(url,), init_process_group=False,
                     timeout=60) == [n * (n + 1) / 2] * n


def _join_env(rank, world_size):
    gc.checked_init_process_group("gloo", join_timeout=10)   # env:// from gc.launch's variables
    out = (dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
    return out


def test_env_rendezvous_reads_the_torchrun_variables():
    assert gc.launch(_join_env, 2, init_process_group=False, timeout=60) == [(0, 2), (1, 2)]


def test_env_rendezvous_twice_through_the_launcher_hosted_store():
    assert gc.launch(_launch_targets.join_env_twice, 2, init_process_group=False, timeout=60) == [[2.0, 2.0]] * 2


def test_env_rendezvous_under_torchrun(tmp_path):
    # torchrun's agent hosts the store at MASTER_PORT and sets TORCHELASTIC_USE_AGENT_STORE=True:
    # rank 0 must join as a client, and the agent's own keys in that store are not "another job"
    script = tmp_path / "join.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        from _launch_targets import join_env_twice
        with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}"), "w") as f:
            f.write(repr(join_env_twice()))
    """))
    path = os.pathsep.join([str(pathlib.Path(gc.__file__).parents[1]), str(pathlib.Path(__file__).parents[1])])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={gc.free_port()}", str(script), str(tmp_path)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["[2.0, 2.0]"] * 2
    assert "failed to bind" not in run.stderr


def _join_with_store(rank, world_size, port):
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    store.set(f"hello/{rank}", str(rank * 10))
    gc.checked_init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                  join_timeout=10)
    other = store.get(f"hello/{1 - rank}").decode()
    dist.destroy_process_group()
    return other


def test_passing_a_store():
    assert gc.launch(_join_with_store, 2, args=(gc.free_port(),), init_process_group=False,
                     timeout=60) == ["10", "0"]


def test_file_rendezvous_cleans_up_and_detects_a_stale_file(tmp_path):
    # FileStore's destructor removes the file when the last rank leaves -- usually: it counts the
    # leavers and the references in two separate locked steps, so two ranks leaving at once can
    # each see the other's count half-done, and neither removes it (torch's race, not ours: 6-221
    # of 3000 pairs here, more under load). Three fresh files: the course's join must not keep a
    # reference that stops the removal every time, and one run in three is enough to show it.
    removed = []
    for attempt in range(3):
        path = tmp_path / f"fresh{attempt}"
        assert gc.launch(_join_and_sum, 2, args=(f"file://{path}",), init_process_group=False,
                         timeout=60) == [3, 3]
        removed.append(not path.exists())
        if removed[-1]:
            break
    assert any(removed), "the file of every clean run was left behind: is a FileStore still held?"
    path = tmp_path / "init"
    url = f"file://{path}"
    # a run that never leaves its group (as if it crashed) leaves the file behind
    gc.launch(_join_and_sum, 2, args=(url, None, None, False), init_process_group=False,
              timeout=60)
    assert path.exists()
    start = time.monotonic()
    with pytest.raises(gc.WorkerError, match="left over from an earlier run"):
        gc.launch(_join_and_sum, 2, args=(url,), init_process_group=False, timeout=60)
    assert time.monotonic() - start < 20


def _plain_join(rank, world_size, url):
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=10))
    dist.barrier()
    return True   # no destroy_process_group: the file stays


def test_stale_file_from_a_plain_init_process_group_is_detected(tmp_path):
    url = f"file://{tmp_path}/init"
    gc.launch(_plain_join, 2, args=(url,), init_process_group=False, timeout=60)
    with pytest.raises(gc.WorkerError, match="fresh, non-existent file|left over"):
        gc.launch(_join_and_sum, 2, args=(url,), init_process_group=False, timeout=60)


# --- checked_init_process_group: bad configurations fail fast, naming the fix -----------------


def test_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(gc.WorkerError, match="already in use.*choose another free port") as e:
            gc.launch(_join_and_sum, 2, args=(url, None, None, True, 3.0),
                      init_process_group=False, timeout=60)
    assert e.value.rank == 0


def test_world_size_smaller_than_the_ranks_joining():
    url = f"tcp://127.0.0.1:{gc.free_port()}"
    with pytest.raises(gc.WorkerError, match="Invalid rank 2.*not machines") as e:
        gc.launch(_join_and_sum, 3, args=(url, None, 2), init_process_group=False, timeout=60)
    assert e.value.rank == 2


def test_world_size_larger_than_the_ranks_joining_times_out_naming_the_missing_rank():
    url = f"tcp://127.0.0.1:{gc.free_port()}"
    start = time.monotonic()
    with pytest.raises(gc.WorkerError, match=r"only 2 of world_size=3.*\[2\] never arrived"):
        gc.launch(_join_and_sum, 2, args=(url, None, 3, True, 2.0), init_process_group=False,
                  timeout=60)
    assert time.monotonic() - start < 20


def test_two_processes_with_one_rank():
    url = f"tcp://127.0.0.1:{gc.free_port()}"
    with pytest.raises(gc.WorkerError, match="rank 1 was claimed by two processes"):
        gc.launch(_join_and_sum, 3, args=(url, [0, 1, 1], 3, True, 5.0),
                  init_process_group=False, timeout=60)


def _only_rank(rank, world_size, url, claimed_rank, join_timeout):
    gc.checked_init_process_group("gloo", url, rank=claimed_rank, world_size=2,
                                  join_timeout=join_timeout)


def test_rank_zero_must_run_on_the_master_address():
    with pytest.raises(gc.WorkerError, match="not an address of this machine"):
        gc.launch(_only_rank, 1, args=("tcp://192.0.2.123:29500", 0, 2.0),
                  init_process_group=False, timeout=30)


def test_unreachable_master_times_out_with_advice():
    url = f"tcp://127.0.0.1:{gc.free_port()}"   # nobody listens there
    with pytest.raises(gc.WorkerError, match="could not reach rank 0's store"):
        gc.launch(_only_rank, 1, args=(url, 1, 1.0), init_process_group=False, timeout=30)


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(backend="tcp"), ValueError, "backend must be"),
    (dict(backend=1), TypeError, "backend must be a str"),
    (dict(rank=0, world_size=0), ValueError, "world_size must be >= 1"),
    (dict(rank=-1, world_size=2), ValueError, "Invalid rank -1"),
    (dict(rank="0", world_size=2), TypeError, "rank must be an int"),
    (dict(timeout=0), ValueError, "timeout must be a positive"),
    (dict(store=object()), ValueError, "either init_method or store"),
])
def test_bad_arguments_fail_before_any_network_activity(kwargs, exc, msg):
    args = dict(backend="gloo", init_method="tcp://127.0.0.1:1", rank=0, world_size=1)
    args.update(kwargs)
    backend = args.pop("backend")
    with pytest.raises(exc, match=msg):
        gc.checked_init_process_group(backend, **args)


def test_nccl_without_gpus_and_env_without_variables(monkeypatch):
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="nccl"):
            gc.checked_init_process_group("nccl", "tcp://127.0.0.1:1", rank=0, world_size=1)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE"):
        gc.checked_init_process_group("gloo")


def _twice(rank, world_size):
    gc.checked_init_process_group("gloo", join_timeout=10)
    try:
        gc.checked_init_process_group("gloo", join_timeout=10)
    except RuntimeError as e:
        return str(e)
    finally:
        dist.destroy_process_group()


def test_initialising_twice_says_destroy_first():
    assert "destroy_process_group() first" in gc.launch(_twice, 1, init_process_group=False,
                                                         timeout=30)[0]


def test_fresh_store_key_counts_are_small():
    assert 0 <= _fresh_key_count("tcp") <= 2 and 0 <= _fresh_key_count("file") <= 2


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE"])
def test_env_rendezvous_names_a_variable_that_is_not_an_integer(monkeypatch, name):
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(gc.free_port())}
    env[name] = "two"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=f"^{name}='two' is not an integer"):
        gc.checked_init_process_group("gloo", join_timeout=5)
    assert not dist.is_initialized()
