"""dist_env_from / DistEnv: torchrun (the real one and gc.launch's), SLURM, OpenPAI, bad input."""

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import gpucourse as gc

# --- torchrun-style variables: the oracle is the process group itself ------------------------


def _env_vs_group(rank, world_size):
    env = gc.dist_env_from()                       # reads the variables gc.launch set, like torchrun
    return (env.rank, env.world_size, env.local_rank, env.node_rank, env.source,
            dist.get_rank(), dist.get_world_size())


def test_torchrun_variables_match_the_real_process_group():
    out = gc.launch(_env_vs_group, 3, timeout=60)
    for rank, (r, ws, local, node, source, g_rank, g_ws) in enumerate(out):
        assert (r, ws) == (g_rank, g_ws) == (rank, 3)
        assert (local, node, source) == (rank, 0, "torchrun")


def _torchrun_env(rank, local, world, lws, node, nnodes=None, **extra):
    env = {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(lws), "GROUP_RANK": str(node), "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500"}
    if nnodes is not None:
        env["GROUP_WORLD_SIZE"] = str(nnodes)
    env.update(extra)
    return env


@given(nnodes=st.integers(1, 6), nproc=st.integers(1, 8), data=st.data())
@settings(max_examples=60, deadline=None)
def test_torchrun_layout_round_trips(nnodes, nproc, data):
    node = data.draw(st.integers(0, nnodes - 1))
    local = data.draw(st.integers(0, nproc - 1))
    rank = gc.global_rank(node, local, nproc)
    env = gc.dist_env_from(_torchrun_env(rank, local, nnodes * nproc, nproc, node))
    assert (env.rank, env.local_rank, env.node_rank, env.nnodes, env.nproc_per_node) == (
        rank, local, node, nnodes, nproc)
    assert gc.dist_env_from(env.to_environ()) == env          # to_environ is what env:// reads
    assert gc.rank_layout(nnodes, nproc)[rank] == (rank, node, local)


def test_nothing_is_read_from_os_environ_when_environ_is_given(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    env = gc.dist_env_from({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1",
                            "SLURM_NODEID": "0", "SLURM_NNODES": "1",
                            "SLURM_TASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "n1",
                            "MASTER_PORT": "1234"})
    assert env.source == "slurm" and env.rank == 0
    with pytest.raises(ValueError, match="missing MASTER_ADDR, MASTER_PORT"):
        gc.dist_env_from({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})


def test_os_environ_is_read_when_environ_is_none(monkeypatch):
    for k, v in _torchrun_env(3, 1, 4, 2, 1).items():
        monkeypatch.setenv(k, v)
    assert gc.dist_env_from().rank == 3


@pytest.mark.parametrize("drop", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
def test_missing_torchrun_variables_are_named(drop):
    env = _torchrun_env(0, 0, 2, 2, 0)
    env.pop(drop)
    if drop == "RANK":  # without RANK it is not a torchrun environment at all
        with pytest.raises(ValueError, match="no distributed launcher variables"):
            gc.dist_env_from(env)
    else:
        with pytest.raises(ValueError, match=drop):
            gc.dist_env_from(env)


def test_hand_written_env_needs_local_rank_and_nproc_per_node_as_arguments():
    env = {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    with pytest.raises(ValueError, match="LOCAL_RANK.*local_rank="):
        gc.dist_env_from(env)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE.*nproc_per_node="):
        gc.dist_env_from(env, local_rank=1)
    e = gc.dist_env_from(env, local_rank=1, nproc_per_node=4)
    assert (e.node_rank, e.nnodes) == (1, 2)


def test_argument_contradicting_the_environment_is_an_error():
    with pytest.raises(ValueError, match="local_rank=0 contradicts LOCAL_RANK=1"):
        gc.dist_env_from(_torchrun_env(1, 1, 2, 2, 0), local_rank=0)
    assert gc.dist_env_from(_torchrun_env(1, 1, 2, 2, 0), local_rank=1).local_rank == 1


@pytest.mark.parametrize("key, value, msg", [
    ("RANK", "x", "RANK='x' is not an integer"),
    ("RANK", "4", "Invalid rank 4"),
    ("MASTER_PORT", "70000", "MASTER_PORT=70000 is not a TCP port"),
    ("LOCAL_RANK", "2", "Invalid local_rank 2"),
])
def test_malformed_values_are_named(key, value, msg):
    env = _torchrun_env(1, 1, 4, 2, 0)
    env[key] = value
    with pytest.raises(ValueError, match=msg):
        gc.dist_env_from(env)


def test_environ_must_be_a_mapping():
    with pytest.raises(TypeError, match="mapping"):
        gc.dist_env_from([("RANK", "0")])


def test_no_launcher_at_all_names_all_three():
    with pytest.raises(ValueError) as err:
        gc.dist_env_from({})
    for name in ("RANK", "SLURM_PROCID", "PAI_TASK_INDEX"):
        assert name in str(err.value)


# --- SLURM ----------------------------------------------------------------------------------


def _slurm(procid, localid, ntasks, nodeid, **extra):
    env = {"SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid),
           "SLURM_NTASKS": str(ntasks), "SLURM_NODEID": str(nodeid)}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def test_slurm_master_is_the_first_host_and_port_comes_from_the_job_id():
    env = gc.dist_env_from(_slurm(6, 2, 8, 1, SLURM_NNODES=2, SLURM_TASKS_PER_NODE="4(x2)",
                                  SLURM_JOB_NODELIST="gpu[07-08]", SLURM_JOB_ID=123456))
    assert (env.rank, env.local_rank, env.node_rank, env.world_size) == (6, 2, 1, 8)
    assert (env.master_addr, env.master_port) == ("gpu07", 15000 + 123456 % 10000)
    assert env.nproc_per_node == 4 and env.source == "slurm"


def test_slurm_explicit_master_wins_and_uneven_tasks_per_node():
    env = gc.dist_env_from(_slurm(4, 0, 5, 2, SLURM_NNODES=3, SLURM_TASKS_PER_NODE="2(x2),1",
                                  SLURM_JOB_NODELIST="a[1-3]", MASTER_ADDR="10.1.1.1",
                                  MASTER_PORT=29400))
    assert (env.master_addr, env.master_port, env.nproc_per_node) == ("10.1.1.1", 29400, 1)


def test_slurm_without_any_master_information_names_what_to_export():
    with pytest.raises(ValueError, match="MASTER_ADDR and SLURM_JOB_NODELIST"):
        gc.dist_env_from(_slurm(0, 0, 1, 0, SLURM_NNODES=1, SLURM_TASKS_PER_NODE=1))
    with pytest.raises(ValueError, match="MASTER_PORT and SLURM_JOB_ID"):
        gc.dist_env_from(_slurm(0, 0, 1, 0, SLURM_NNODES=1, SLURM_TASKS_PER_NODE=1,
                                SLURM_JOB_NODELIST="n1"))
    with pytest.raises(ValueError, match="SLURM_LOCALID"):
        gc.dist_env_from({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODEID": "0"})


def test_slurm_missing_task_count_names_the_variable_and_its_alias():
    env = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    with pytest.raises(ValueError, match=r"missing SLURM_NTASKS \(or SLURM_NPROCS\);"):
        gc.dist_env_from(env)
    with pytest.raises(ValueError, match=r"missing SLURM_LOCALID, SLURM_NTASKS \(or SLURM_NPROCS\)"):
        gc.dist_env_from({"SLURM_PROCID": "0", "SLURM_NODEID": "0"})
    both = {**env, "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "2", "MASTER_ADDR": "h",
            "MASTER_PORT": "1"}
    assert gc.dist_env_from({**both, "SLURM_NPROCS": "2"}).world_size == 2       # the alias works
    assert gc.dist_env_from({**both, "SLURM_NTASKS": "2"}).world_size == 2


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("single", ["single"]),
    ("a[1-2],b,c[5]", ["a1", "a2", "b", "c5"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("gpu-[1,3]-ib", ["gpu-1-ib", "gpu-3-ib"]),
])
def test_expand_slurm_nodelist_examples(nodelist, hosts):
    assert gc.expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad, msg", [
    ("node[01-03", "never closed"), ("node01]", "without"), ("n[3-1]", "backwards"),
    ("n[a-b]", "not a number"), ("n[[1]]", "nested"), ("a,,b", "empty host"), ("", "empty"),
])
def test_expand_slurm_nodelist_rejects_malformed(bad, msg):
    with pytest.raises(ValueError, match=msg):
        gc.expand_slurm_nodelist(bad)


_runs = st.lists(st.tuples(st.integers(0, 120), st.integers(0, 5)), min_size=1, max_size=4)


@given(prefix=st.from_regex(r"[a-z][a-z0-9-]{0,6}", fullmatch=True), runs=_runs,
       width=st.integers(1, 4))
@settings(max_examples=80, deadline=None)
def test_expand_slurm_nodelist_inverts_compression(prefix, runs, width):
    """Compress hosts the way SLURM prints them, expand again: the same hosts in the same order."""
    entries, hosts = [], []
    for start, length in runs:
        lo, hi = str(start).zfill(width), str(start + length).zfill(width)
        entries.append(lo if length == 0 else f"{lo}-{hi}")
        hosts += [prefix + str(i).zfill(width) for i in range(start, start + length + 1)]
    assert gc.expand_slurm_nodelist(f"{prefix}[{','.join(entries)}]") == hosts


# --- OpenPAI (the seeds) -----------------------------------------------------------------------


def _pai(index, **extra):
    env = {"PAI_TASK_INDEX": str(index), "PAI_HOST_IP_worker_0": "10.0.0.9",
           "PAI_worker_0_SynPort_PORT": "31000"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


@given(nodes=st.integers(1, 8), gpus=st.integers(1, 8), data=st.data())
@settings(max_examples=50, deadline=None)
def test_openpai_rank_is_task_index_times_gpus_plus_gpu(nodes, gpus, data):
    index, gpu = data.draw(st.integers(0, nodes - 1)), data.draw(st.integers(0, gpus - 1))
    env = gc.dist_env_from(_pai(index), local_rank=gpu, nproc_per_node=gpus, nnodes=nodes)
    assert env.rank == index * gpus + gpu                    # the seeds' formula
    assert env.world_size == nodes * gpus                    # processes, not machines
    assert env.init_method == "tcp://10.0.0.9:31000"


def test_openpai_reads_the_task_count_and_names_missing_arguments():
    env = gc.dist_env_from(_pai(1, PAI_TASK_ROLE_TASK_COUNT_worker=4), local_rank=0,
                           nproc_per_node=8)
    assert (env.nnodes, env.world_size, env.rank) == (4, 32, 8)
    with pytest.raises(ValueError, match="nproc_per_node="):
        gc.dist_env_from(_pai(0), local_rank=0, nnodes=2)
    with pytest.raises(ValueError, match="local_rank="):
        gc.dist_env_from(_pai(0), nproc_per_node=2, nnodes=2)
    with pytest.raises(ValueError, match="PAI_worker_0_SynPort_PORT"):
        gc.dist_env_from({"PAI_TASK_INDEX": "0", "PAI_HOST_IP_worker_0": "h"})
    with pytest.raises(ValueError, match="Invalid local_rank 8"):
        gc.dist_env_from(_pai(0), local_rank=8, nproc_per_node=8, nnodes=1)


# --- DistEnv and the rank arithmetic ----------------------------------------------------------


def test_dist_env_validates_itself():
    with pytest.raises(ValueError, match="counts processes, not machines"):
        gc.DistEnv(rank=2, local_rank=0, world_size=2, master_addr="h", master_port=1)
    with pytest.raises(TypeError, match="rank must be an int"):
        gc.DistEnv(rank="0", local_rank=0, world_size=2, master_addr="h", master_port=1)
    with pytest.raises(ValueError, match="master_addr"):
        gc.DistEnv(rank=0, local_rank=0, world_size=2, master_addr=" ", master_port=1)
    assert gc.DistEnv(0, 0, 1, "::1", 29500).init_method == "tcp://[::1]:29500"


def test_seeds_cluster_four_nodes_of_eight_gpus():
    layout = gc.rank_layout(4, 8)
    assert len(layout) == 32
    assert layout[-1] == (31, 3, 7) and gc.global_rank(2, 5, 8) == 21
    with pytest.raises(ValueError, match="local_rank must be in"):
        gc.global_rank(0, 8, 8)
    with pytest.raises(ValueError, match="nproc_per_node must be >= 1"):
        gc.rank_layout(2, 0)
