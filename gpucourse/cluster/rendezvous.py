"""Rendezvous: how the processes of a job find each other — and clear errors when they cannot.

``init_process_group`` first makes every process meet at a *store*, a small key-value server that
all of them can reach. Each process writes its own address there and reads the others', then the
backend (gloo, nccl) connects them directly. The ``init_method`` says where the store is:

* ``tcp://host:port`` — rank 0 runs a :class:`torch.distributed.TCPStore` server on ``port`` of
  its machine ``host``; everyone else connects to it.
* ``env://`` (the default) — the same, with host and port read from ``MASTER_ADDR`` and
  ``MASTER_PORT`` (and ``RANK``, ``WORLD_SIZE``) — what torchrun sets. torchrun (and
  ``gc.launch``) go one step further: the launcher itself already hosts the store there and sets
  ``TORCHELASTIC_USE_AGENT_STORE=True``, so every rank, rank 0 included, connects as a client.
* ``file:///path`` — a :class:`torch.distributed.FileStore` on a file every process can see (a
  shared file system across machines). The file must not exist yet.
* or pass a store you built yourself: ``init_process_group(backend, store=..., rank=..., world_size=...)``.

Misconfigured, a rendezvous does not fail: it *waits* — by default for 30 minutes — or fails with a
message about keys and sockets. :func:`checked_init_process_group` does the same job as
``init_process_group`` but checks the configuration first and watches the rendezvous, so each
classic mistake ends quickly with the problem and its fix named: a malformed URL, a port already in
use, rank 0 on the wrong machine, a ``world_size`` that does not match the processes started, two
processes with the same rank, a ``file://`` left over from an earlier run.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import time
import urllib.parse
from dataclasses import dataclass
from functools import cache

from ..runtime import check_int

__all__ = ["InitMethod", "checked_init_process_group", "parse_init_method"]

_SCHEMES = ("tcp", "file", "env")
_EXAMPLES = "tcp://10.0.0.1:29500, file:///mnt/shared/job42.init or env://"
_PREFIX = "gpucourse/join/"
_agent_joins = 0  # how many times this process joined through a launcher-hosted store


@dataclass(frozen=True)
class InitMethod:
    """A parsed ``init_method`` URL (see :func:`parse_init_method`).

    Args:
        scheme: ``"tcp"``, ``"file"`` or ``"env"``.
        host, port: rank 0's machine and port (``tcp`` only).
        path: the absolute path of the shared file (``file`` only).

    Example::

        >>> InitMethod("tcp", "::1", 29500).url          # IPv6 addresses get brackets
        'tcp://[::1]:29500'

    .. warning::
        Build it with :func:`parse_init_method`: the constructor does not check its fields.
    """

    scheme: str
    host: str | None = None
    port: int | None = None
    path: str | None = None

    @property
    def url(self) -> str:
        if self.scheme == "tcp":
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"tcp://{host}:{self.port}"
        if self.scheme == "file":
            return f"file://{self.path}"
        return "env://"


def parse_init_method(url: str) -> InitMethod:
    """Check an ``init_method`` URL and split it into its parts.

    Example::

        >>> parse_init_method("tcp://10.1.1.20:23456")
        InitMethod(scheme='tcp', host='10.1.1.20', port=23456, path=None)
        >>> parse_init_method("file:///mnt/nfs/sharedfile").path
        '/mnt/nfs/sharedfile'
        >>> parse_init_method("tcp://10.1.1.20")
        Traceback (most recent call last):
        ...
        ValueError: init_method 'tcp://10.1.1.20' has no port: write tcp://10.1.1.20:PORT with a free port on rank 0's machine, e.g. tcp://10.1.1.20:29500

    .. warning::
        ``tcp://`` takes the address of the machine that runs **rank 0**, the same string on every
        machine. ``localhost``/``127.0.0.1`` only works when every process runs on that machine.
    """
    if not isinstance(url, str):
        raise TypeError(f"init_method must be a str such as {_EXAMPLES}, got {type(url).__name__}")
    text = url.strip()
    if "://" not in text:
        scheme = text.split(":", 1)[0] if ":" in text else ""
        hint = (f"it needs '//' after the scheme: {scheme}://..." if scheme in _SCHEMES
                else f"expected one of {_EXAMPLES}")
        raise ValueError(f"init_method {url!r} is not a URL; {hint}")
    parts = urllib.parse.urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"init_method {url!r} has scheme {scheme!r}; init_process_group knows "
                         f"tcp://, file:// and env:// (e.g. {_EXAMPLES})")
    if scheme == "env":
        if parts.netloc or parts.path not in ("", "/"):
            raise ValueError(f"init_method {url!r}: env:// takes no address; it reads MASTER_ADDR "
                             "and MASTER_PORT from the environment. Write just 'env://'")
        return InitMethod("env")
    if scheme == "file":
        if parts.netloc:
            raise ValueError(
                f"init_method {url!r}: a file URL needs an absolute path and three slashes, "
                f"file:///{parts.netloc}{parts.path} — '{parts.netloc}' was read as a host name")
        if not parts.path.startswith("/") or parts.path.endswith("/"):
            raise ValueError(f"init_method {url!r} must name a file by its absolute path, e.g. "
                             "file:///mnt/shared/job42.init")
        return InitMethod("file", path=urllib.parse.unquote(parts.path))
    # tcp
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(f"init_method {url!r}: tcp:// takes only host:port, e.g. "
                         "tcp://10.0.0.1:29500")
    host = parts.hostname
    if not host:
        raise ValueError(f"init_method {url!r} has no host: write tcp://<address of rank 0's "
                         "machine>:<port>, e.g. tcp://10.0.0.1:29500")
    try:
        port = parts.port
    except ValueError:
        raw = parts.netloc.rsplit(":", 1)[-1]
        raise ValueError(f"init_method {url!r}: port {raw!r} is not a number in 1-65535") from None
    if port is None:
        raise ValueError(f"init_method {url!r} has no port: write tcp://{host}:PORT with a free "
                         f"port on rank 0's machine, e.g. tcp://{host}:29500")
    if port == 0:
        raise ValueError(f"init_method {url!r}: port 0 means 'any free port', which the other "
                         "processes cannot know; choose a fixed port such as 29500")
    return InitMethod("tcp", host=host, port=port)


def _seconds(name: str, value) -> float:
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds or a timedelta, got {value!r}")
    return float(value)


def _is_local_address(host: str) -> bool:
    """Can this machine listen on ``host``? (Is it one of this machine's addresses?)"""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"master address {host!r} does not resolve ({e.strerror}); use rank 0's "
                         "IP address or a host name every machine can resolve") from None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((sockaddr[0], 0))
                return True
            except OSError:
                continue
    return False


@cache
def _fresh_key_count(kind: str) -> int:
    """Keys a brand-new store of this kind reports (FileStore keeps an internal user counter)."""
    import tempfile

    import torch.distributed as dist

    if kind == "file":
        with tempfile.TemporaryDirectory() as tmp:
            store = dist.FileStore(os.path.join(tmp, "probe"), 1)
            n = store.num_keys()
            del store
            return n
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    return store.num_keys()


def _agent_store_serves(method: InitMethod) -> bool:
    """Whether a launcher (torchrun, ``gc.launch``) already hosts the store at this address.

    torchrun sets ``TORCHELASTIC_USE_AGENT_STORE=True`` when its agent serves the store at the
    ``MASTER_ADDR:MASTER_PORT`` it exports; there rank 0 must not try to start a server of its own.
    The same rule as ``torch.distributed.rendezvous``: only for exactly that address.
    """
    return (method.scheme == "tcp"
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("MASTER_ADDR") == method.host
            and os.environ.get("MASTER_PORT") == str(method.port))


def _make_store(method: InitMethod, rank: int, world_size: int, join_timeout: float):
    """The store ``init_process_group`` would build for this URL — with errors that say the fix."""
    import torch.distributed as dist

    td = datetime.timedelta(seconds=join_timeout)
    if method.scheme == "file":
        parent = os.path.dirname(method.path) or "/"
        if not os.path.isdir(parent):
            raise ValueError(f"init_method {method.url!r}: directory {parent!r} does not exist. On "
                             "several machines it must be on a file system that every machine "
                             "mounts at the same path (e.g. NFS)")
        return dist.FileStore(method.path, world_size), "file"
    if _agent_store_serves(method):
        # torchrun / gc.launch already host the store at MASTER_ADDR:MASTER_PORT: every rank is a
        # client. The store is shared with the launcher's own keys (and with earlier joins of this
        # run), so each join gets its own key prefix — the same on every rank, as every rank makes
        # the same sequence of calls.
        global _agent_joins
        _agent_joins += 1
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        try:
            client = dist.TCPStore(method.host, method.port, world_size, is_master=False, timeout=td)
        except RuntimeError as e:
            raise TimeoutError(
                f"rank {rank} could not reach the launcher's store at {method.host}:{method.port} "
                f"within {join_timeout:g} s: has the launcher (torchrun) exited? ({e})") from None
        return dist.PrefixStore(f"gpucourse/agent/{run}/{attempt}/{_agent_joins}", client), "agent"
    if rank == 0 and not _is_local_address(method.host):
        raise ValueError(
            f"this process is rank 0, but the master address {method.host!r} is not an address of "
            f"this machine ({socket.gethostname()}). Rank 0 hosts the store, so start rank 0 "
            "(--node_rank=0) on the machine whose address you give as master address")
    try:
        # TCPStore alone listens on every interface; for a loopback URL rank 0 listens there only
        listen_fd = _loopback_listener(method.host, method.port) if rank == 0 else None
        store = dist.TCPStore(method.host, method.port, world_size, is_master=(rank == 0),
                              timeout=td, wait_for_workers=False, master_listen_fd=listen_fd)
    except (RuntimeError, OSError) as e:
        text = str(e)
        if rank == 0 and ("EADDRINUSE" in text or "already in use" in text):
            raise RuntimeError(
                f"port {method.port} on {method.host} is already in use (by another job, or a "
                "previous run that has not exited), so rank 0 cannot host the store there. Fix: "
                "choose another free port (gc.free_port() finds one) for every process, or let "
                "torchrun choose with --standalone / --rdzv-endpoint=HOST:0") from None
        if rank != 0 and ("timed out" in text or "Timed out" in text or "Connection refused" in text
                          or "Ping failed" in text):
            raise TimeoutError(
                f"rank {rank} could not reach rank 0's store at {method.host}:{method.port} within "
                f"{join_timeout:g} s. Check that rank 0 (node_rank 0) has started, that "
                f"{method.host!r} is its address as seen from this machine (127.0.0.1 only works "
                "on one machine), that every node uses the same port, and that no firewall blocks "
                "it") from None
        raise
    return store, "tcp"


def _int_from_env(name: str) -> int:
    raw = os.environ[name].strip()
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer (env:// reads {name} from the "
                         "environment; torchrun sets it)") from None


def _loopback_listener(host: str, port: int) -> int | None:
    """A socket listening on ``host:port`` when ``host`` is a loopback address, else ``None``."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return None
    if not loopback:
        return None
    host = "127.0.0.1" if host == "localhost" else host
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        return sock.detach()    # the store owns it from now on (and closes it)


def _join(store, rank: int, world_size: int, join_timeout: float, fresh_keys: int | None,
          where: str) -> None:
    """Every process claims its rank in the store, then waits (with a deadline) for all the others.

    Catches what the plain rendezvous turns into a long wait or an obscure error: a store already
    holding another run's keys, two processes with one rank, too few processes for ``world_size``.
    """
    abort = _PREFIX + "abort"
    # 1) the first process to arrive checks the store is empty: nothing of this run has been
    #    written before its `add`, so any key beyond a fresh store's is left from another run
    existing = store.num_keys()
    first = store.add(_PREFIX + "arrivals", 1) == 1
    if first and fresh_keys is not None and existing > fresh_keys:
        msg = (f"{where} already holds {existing - fresh_keys} key(s) from an earlier run or another "
               "job. A file:// store must be a fresh, non-existent file for every run: delete it "
               "or use a new file name (e.g. with the job id in it)"
               if where.startswith("file") else
               f"{where} already holds keys from another job: pick another port")
        store.set(abort, msg)
        raise RuntimeError(msg)
    # 2) claim the rank: compare_set only writes when the key does not exist yet
    me = f"{socket.gethostname()}:{os.getpid()}"
    holder = store.compare_set(_PREFIX + f"rank/{rank}", "", me).decode()
    if holder != me:
        host, _, pid = holder.rpartition(":")
        if host == socket.gethostname() and pid.isdigit() and not _pid_alive(int(pid)):
            msg = (f"{where} is left over from an earlier run: rank {rank} is registered there by "
                   f"process {pid}, which has exited. Use a fresh file (or port) for every run")
        else:
            msg = (f"rank {rank} was claimed by two processes ({holder} and {me}). Every process "
                   "needs its own rank = node_rank × nproc_per_node + local_rank: check --node_rank "
                   "and nproc_per_node on every machine"
                   + (f" (or {where} is left over from an earlier run)" if where.startswith("file")
                      else ""))
        store.set(abort, msg)
        raise RuntimeError(msg)
    # 3) wait for all ranks, watching for an abort from another process
    missing = _wait_all(store, "rank", rank, world_size, join_timeout)
    if missing:
        arrived = store.add(_PREFIX + "arrivals", 0)
        raise TimeoutError(
            f"rank {rank}: only {world_size - len(missing)} of world_size={world_size} ranks "
            f"joined within {join_timeout:g} s; rank(s) {missing} never arrived ({arrived} "
            "process(es) reached the store). world_size must equal the number of processes "
            "started (nnodes × nproc_per_node, not the number of machines); every node must "
            "be started, with the same master address and port")


def _wait_all(store, what: str, rank: int, world_size: int, timeout: float) -> list[int]:
    """Wait until every rank has set ``<prefix><what>/<r>``; return the ranks still missing."""
    keys = [_PREFIX + f"{what}/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if store.check([_PREFIX + "abort"]):
            raise RuntimeError(f"rank {rank}: another process stopped the rendezvous: "
                               f"{store.get(_PREFIX + 'abort').decode()}")
        if time.monotonic() > deadline:
            return [r for r, k in enumerate(keys) if not store.check([k])]
        time.sleep(0.02)
    return []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def checked_init_process_group(backend: str = "gloo", init_method: str | None = None, *,
                               rank: int | None = None, world_size: int | None = None, store=None,
                               timeout: float | datetime.timedelta = 60.0,
                               join_timeout: float | datetime.timedelta | None = None) -> None:
    """``torch.distributed.init_process_group`` with the configuration checked and the rendezvous
    watched, so a mistake ends in seconds with a message that names the fix.

    Same meaning as in ``init_process_group``; then, before the backend connects:

    1. the backend, ``rank``/``world_size`` and the URL are checked (:func:`parse_init_method`);
    2. the store is built as ``init_method`` says (rank 0 must be on the master address; the port
       must be free);
    3. every process registers its rank in the store and waits at most ``join_timeout`` seconds for
       the others — a stale ``file://``, a duplicate rank or missing ranks raise at once;
    4. after ``init_process_group``, it returns only when every rank is connected (and rank 0,
       which may host the store, only after the others are done with it).

    Args:
        backend: ``"gloo"`` (CPU, or GPUs without NCCL), ``"nccl"`` (CUDA GPUs), ``"mpi"``.
        init_method: ``tcp://host:port``, ``file:///path`` or ``env://``; default ``env://``
            unless ``store`` is given.
        rank, world_size: this process's global rank and the number of processes (``env://``
            reads ``RANK``/``WORLD_SIZE`` when they are not given).
        store: a store to meet at instead of ``init_method`` (TCPStore, FileStore, HashStore …).
        timeout: seconds a collective may wait before it fails (``init_process_group(timeout=)``;
            the default there is 30 minutes, which looks like a hang).
        join_timeout: seconds to wait for every process at the rendezvous (default: ``timeout``).

    Raises:
        ValueError: a malformed URL, a bad rank/world size, an unavailable backend, rank 0 not on
            the master address.
        RuntimeError: port in use, duplicate rank, a store left over from another run, a process
            group already initialised.
        TimeoutError: not every rank arrived within ``join_timeout``, or rank 0's store was
            unreachable.

    Example::

        >>> import gpucourse as gc, torch.distributed as dist
        >>> def join(rank, world_size, url):
        ...     checked_init_process_group("gloo", url, rank=rank, world_size=world_size,
        ...                                join_timeout=10)
        ...     dist.destroy_process_group()
        ...     return dist.is_initialized()
        >>> gc.launch(join, 2, args=(f"tcp://127.0.0.1:{gc.free_port()}",),
        ...           init_process_group=False)
        [False, False]
        >>> checked_init_process_group("gloo", "tcp://127.0.0.1:29500", rank=2, world_size=2)
        Traceback (most recent call last):
        ...
        ValueError: Invalid rank 2, rank should be in the interval [0, 1]. world_size counts processes (nnodes × nproc_per_node), not machines

    .. warning::
        The checks cost a few extra round trips through the store per process. They catch
        configuration mistakes at start-up; a collective that only some ranks call later is
        caught by ``timeout`` (and ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` names the rank).
    """
    import torch
    import torch.distributed as dist

    # 1) arguments
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str such as 'gloo' or 'nccl', got {type(backend).__name__}")
    backend = backend.lower()
    if backend not in ("gloo", "nccl", "mpi"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or 'mpi', got {backend!r}")
    if not dist.is_backend_available(backend):
        raise ValueError(f"backend {backend!r} is not available in this PyTorch build "
                         f"({torch.__version__}); gloo works everywhere, nccl needs a CUDA build, "
                         "mpi a PyTorch built from source against MPI")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA GPUs and this machine has none; use 'gloo'")
    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialised in this process; call "
                           "torch.distributed.destroy_process_group() first")
    timeout_s = _seconds("timeout", timeout)
    join_s = timeout_s if join_timeout is None else _seconds("join_timeout", join_timeout)
    if store is not None and init_method is not None:
        raise ValueError("pass either init_method or store, not both")

    method = None
    if store is None:
        method = parse_init_method(init_method or "env://")
        if method.scheme == "env":
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
            missing += [k for k, v in (("RANK", rank), ("WORLD_SIZE", world_size))
                        if v is None and not os.environ.get(k)]
            if missing:
                raise ValueError(f"env:// reads {', '.join(missing)} from the environment, but "
                                 "they are not set; start with torchrun, or export them (or pass "
                                 "rank=/world_size=)")
            method = parse_init_method(f"tcp://{os.environ['MASTER_ADDR']}:"
                                       f"{os.environ['MASTER_PORT']}")
            rank = _int_from_env("RANK") if rank is None else rank
            world_size = _int_from_env("WORLD_SIZE") if world_size is None else world_size
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is None:
            raise ValueError(f"{name} must be given with this init_method")
        check_int(name, value)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {world_size - 1}]. "
                         "world_size counts processes (nnodes × nproc_per_node), not machines")

    # 2) the store
    fresh = None
    if store is None:
        store, kind = _make_store(method, rank, world_size, join_s)
        fresh = None if kind == "agent" else _fresh_key_count(kind)  # a key prefix of its own
        where = f"file {method.path}" if kind == "file" else f"the store at {method.host}:{method.port}"
    else:
        where = f"the {type(store).__name__} you passed"
    # 3) meet, then let the backend connect
    _join(store, rank, world_size, join_s, fresh, where)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    # 4) return only when every rank is connected: a fast rank that left the group at once could
    #    otherwise close its sockets while a slower one is still completing the handshake
    store.set(_PREFIX + f"connected/{rank}", "1")
    missing = _wait_all(store, "connected", rank, world_size, join_s)
    if missing:
        raise TimeoutError(f"rank {rank}: rank(s) {missing} joined the store but did not finish "
                           f"connecting within {join_s:g} s (a firewall between the machines, or "
                           "the wrong network interface: set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME)")
    # 5) the store may live in rank 0's process: rank 0 returns last, once nobody polls it anymore
    if rank != 0:
        store.set(_PREFIX + f"done/{rank}", "1")
    else:
        store.set(_PREFIX + "done/0", "1")
        _wait_all(store, "done", rank, world_size, join_s)
