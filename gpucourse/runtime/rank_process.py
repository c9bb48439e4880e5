"""Inside one rank started by :func:`~gpucourse.launch`: set up, join the group, run ``fn``, report.

:func:`rank_main` is the body of every rank process:

1) become its own process group and a child subreaper (so the launcher can stop it *and* anything
   it starts), send its output to files, and wait for the launcher's store port;
2) set ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` as torchrun does and
   join a fresh process group (unless told not to);
3) run ``fn(rank, world_size, *args)``, wait for every rank at a closing barrier, send back the
   result — or the exception's type and traceback — and leave the group;
4) before exiting, kill whatever ``fn`` started and left running.

It talks to the launcher through two pipes: the store's port arrives on one, and on the other it
sends ``("joined",)``, ``("returned",)`` and finally ``("ok", pickled result)`` or
``("error", exception type name, traceback text)``.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import io
import os
import pickle
import signal
import sys
import traceback

from .process_tree import LAUNCH_ID_VARIABLE, become_subreaper, kill_my_descendants

__all__ = ["rank_main"]


def rank_main(task, rank, world_size, backend, init_pg, port_conn, timeout, paths, conn, forked,
              launch_id, loopback, environ=None):
    """Body of every rank; ``task`` is ``(fn, args)``, or its cloudpickle bytes when not forked;
    ``environ``: the launcher's environment, for a rank forked by the fork server (which has its own)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    os.setpgid(0, 0)  # own process group: the parent can kill us *and* whatever we start
    # not the launcher's "Ctrl-C later" handler a fork copies (see processes._ctrl_c_deferred)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _linux_child_setup(f"gpucourse-rank{rank}")
    become_subreaper()  # an orphan of anything we start stays below us, where the launcher looks
    os.environ[LAUNCH_ID_VARIABLE] = launch_id  # inherited by what we start: orphans are recognised
    stdout_path, stderr_path, stack_path = paths
    _redirect_output(stdout_path, stderr_path)
    faulthandler.enable(sys.stderr)  # a segfault still leaves a Python stack in the rank's output
    if hasattr(signal, "SIGUSR1"):  # the parent sends SIGUSR1 before killing a hung rank
        stack_file = open(stack_path, "w")  # noqa: SIM115 - must stay open until the process ends
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)

    # the parent creates the store only once every rank has been started (see launch)
    if not port_conn.poll(timeout):
        os._exit(3)
    port = port_conn.recv()
    port_conn.close()

    import torch

    # GNU OpenMP (torch's CPU thread pool) cannot be used from a forked child once the parent has
    # run a parallel region: a child asking for >1 thread may wait forever. One intra-op thread
    # per rank is also what torchrun sets (OMP_NUM_THREADS=1) — the ranks are the parallelism.
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
        OMP_NUM_THREADS="1",
        # as under torchrun: the store at MASTER_ADDR:MASTER_PORT is hosted by the launcher (the
        # parent), so env:// makes every rank a client of it, rank 0 included
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    if loopback:  # gloo listens on the interface named here (default: the host name's address)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    # init_process_group returns only once every rank has joined (torch's own store-based barrier).
    # Without it, a rank that joins and leaves at once closes connections a slower peer is still
    # setting up ("Gloo connectFullMesh failed ... Connection closed by peer").
    os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
    import torch.distributed as dist

    _agent_store_only_at_master_port()

    message: tuple
    client = None
    try:
        fn, args = pickle.loads(task) if isinstance(task, bytes) else task
        if not init_pg and not forked:
            # spawned ranks each import torch afresh: seconds apart on a busy machine. fn often
            # joins a group itself with a short timeout, so all start it together (a forked rank
            # starts in milliseconds; init_process_group has its own start barrier)
            client = dist.TCPStore("127.0.0.1", port, is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout))
            _starting_line(client, rank, world_size)
        if init_pg:
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            # every rank is a client of the store the parent hosts (what torchrun's agent does)
            client = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout))
            store = dist.PrefixStore("gpucourse/pg", client)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout))
        conn.send(("joined",))
        result = fn(rank, world_size, *args)
        conn.send(("returned",))
        if client is None:  # one connection per rank: each one costs a reverse DNS lookup in torch
            client = dist.TCPStore("127.0.0.1", port, is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        _closing_barrier(client, rank, world_size)
        message = _result_message(result, rank, forked)
    except SystemExit as e:
        if e.code in (0, None):
            message = ("ok", pickle.dumps(None))
        else:
            message = ("error", "SystemExit", f"SystemExit({e.code!r}) raised in rank {rank}\n"
                       + traceback.format_exc())
    except BaseException as e:  # noqa: BLE001 - everything must reach the parent
        message = ("error", type(e).__name__, traceback.format_exc())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    conn.send(message)
    conn.close()
    if init_pg and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    kill_my_descendants()  # nothing fn started outlives the rank, not even in another session
    sys.stdout.flush()
    sys.stderr.flush()
    if forked:  # skip atexit handlers and finalizers inherited from the parent (e.g. the kernel's)
        os._exit(0)


def _result_message(result, rank: int, forked: bool) -> tuple:
    """``("ok", bytes)``, or an ``"error"`` message saying the return value cannot travel.

    A spawned rank received ``fn`` by value (cloudpickle), classes defined in the notebook
    included; its result goes back the same way, so such objects arrive as what they were.
    """
    try:
        if forked:
            return "ok", pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        import cloudpickle

        return "ok", cloudpickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001
        why = (f"rank {rank} finished, but its return value could not be sent back to the parent "
               f"({type(e).__name__}: {e}). Return plain data: numbers, lists, dicts, tensors.\n")
        return "error", type(e).__name__, why


def _agent_store_only_at_master_port() -> None:
    """Give torch 2.11 and older the rule newer torch has: ``TORCHELASTIC_USE_AGENT_STORE`` means "the
    launcher serves the store at ``MASTER_ADDR:MASTER_PORT``" — not at every ``tcp://`` address.

    Older torch took every ``tcp://`` URL as the launcher's store, so a rank that joins a group of
    its own at ``tcp://127.0.0.1:<free port>`` (lesson 05) found no server there: rank 0, which
    should host it, became one more client (seen on an H200 with torch 2.11: "The client socket has
    timed out after 10000ms"). Newer torch (``rendezvous._agent_store_serves``) checks the address.
    """
    import importlib

    rendezvous = importlib.import_module("torch.distributed.rendezvous")   # the module, not the function
    original = getattr(rendezvous, "_create_c10d_store", None)
    if original is None or not _torch_takes_every_url_for_the_agents(rendezvous):
        return

    def create(hostname, port, *args, **kwargs):
        if (hostname, str(port)) == (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")):
            return original(hostname, port, *args, **kwargs)
        saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)   # rank 0 hosts, as it should
        try:
            return original(hostname, port, *args, **kwargs)
        finally:
            if saved is not None:
                os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved

    rendezvous._create_c10d_store = create


def _torch_takes_every_url_for_the_agents(rendezvous) -> bool:
    return not hasattr(rendezvous, "_agent_store_serves")     # the check newer torch makes


def _starting_line(store, rank: int, world_size: int) -> None:
    """Wait until every spawned rank has imported torch and unpickled ``fn`` before any runs it."""
    store.set(f"gpucourse/ready/{rank}", "1")
    store.wait([f"gpucourse/ready/{r}" for r in range(world_size)])


def _closing_barrier(store, rank: int, world_size: int) -> None:
    """Wait until every rank has returned from ``fn`` before anyone tears down its sockets.

    Without it, a rank that finishes a collective early could close connections a peer is still
    reading from ("Connection closed by peer"), and rank 0 — which hosts the store when ``fn``
    creates its group from its own ``tcp://`` address — could leave while a peer still needs it.
    It goes through the parent's store, not ``dist.barrier()``, so it can never pair up with a
    barrier that ``fn`` called on only some ranks, and it works when ``fn`` manages (or already
    destroyed) its own group. Rank 0 leaves last.
    """
    store.set(f"gpucourse/returned/{rank}", "1")
    store.wait([f"gpucourse/returned/{r}" for r in range(world_size)])
    if rank != 0:
        store.set(f"gpucourse/left/{rank}", "1")
    else:
        store.wait([f"gpucourse/left/{r}" for r in range(1, world_size)])


def _linux_child_setup(name: str, *, die_with_parent: bool = True) -> None:
    """Linux only: name this process and (unless told not to) have it die with its parent.

    1) ``PR_SET_NAME``: the process shows as ``name`` (at most 15 bytes) in ``ps -e``, ``top`` and
       ``pgrep gpucourse-rank``, instead of as one more copy of the kernel's ``python``;
    2) ``PR_SET_PDEATHSIG``: the kernel kills this child if the parent (the notebook kernel) dies.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
        if die_with_parent:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:  # pragma: no cover - exotic libc
        pass


def _redirect_output(stdout_path: str, stderr_path: str) -> None:
    """Point fd 1/2 *and* sys.stdout/sys.stderr at this rank's files.

    Both levels matter: ``print`` goes through ``sys.stdout`` (in a notebook that is an ipykernel
    stream whose sender thread does not exist in a forked child), while C++ warnings from
    torch/gloo write straight to file descriptor 2.
    """
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)
    sys.stdin = open(os.devnull)
