"""Who am I in the job? Reading a process's place in a multi-node job from its environment.

Every process of a distributed job must know five things before it can join the process group:
its global ``rank``, its ``local_rank`` on its machine (which GPU to use), the ``world_size`` (the
number of *processes*, not machines), and where rank 0 listens (``master_addr``, ``master_port``).
A launcher puts them into environment variables — each launcher under its own names:

=================  ==============  ===================  ================================
                   torchrun        SLURM (``srun``)     OpenPAI (the seeds' recipe)
=================  ==============  ===================  ================================
global rank        ``RANK``        ``SLURM_PROCID``     task index × GPUs per node + GPU
local rank         ``LOCAL_RANK``  ``SLURM_LOCALID``    the ``mp.spawn`` index (argument)
world size         ``WORLD_SIZE``  ``SLURM_NTASKS``     nodes × GPUs per node (arguments)
node rank          ``GROUP_RANK``  ``SLURM_NODEID``     ``PAI_TASK_INDEX``
master address     ``MASTER_ADDR`` first host of        ``PAI_HOST_IP_worker_0``
                                   ``SLURM_JOB_NODELIST``
master port        ``MASTER_PORT`` ``MASTER_PORT``      ``PAI_worker_0_SynPort_PORT``
=================  ==============  ===================  ================================

:func:`dist_env_from` reads any of the three into one :class:`DistEnv`, and
:meth:`DistEnv.to_environ` writes it back under torchrun's names, which is what
``init_process_group(init_method="env://")`` reads. So one training script runs unchanged under
torchrun, ``srun`` and OpenPAI::

    env = gc.dist_env_from()                    # reads os.environ
    os.environ.update(env.to_environ())
    torch.cuda.set_device(env.local_rank)       # on a GPU machine
    dist.init_process_group("nccl")             # env://

The arithmetic behind all of them is one line, :func:`global_rank`:
``rank = node_rank × nproc_per_node + local_rank``.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..runtime import check_int

__all__ = ["DistEnv", "dist_env_from", "expand_slurm_nodelist", "global_rank", "rank_layout"]

_TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SLURM = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID")
_PAI = ("PAI_TASK_INDEX", "PAI_HOST_IP_worker_0", "PAI_worker_0_SynPort_PORT")


@dataclass(frozen=True)
class DistEnv:
    """One process's place in a distributed job.

    Args:
        rank: global rank, ``0 … world_size-1``. Unique over the whole job.
        local_rank: rank on this machine, ``0 … nproc_per_node-1``; on a GPU machine, the GPU to use.
        world_size: the number of *processes* in the job (usually one per GPU) — not the number of
            machines.
        master_addr: address of the machine running rank 0, reachable from every machine.
        master_port: a free TCP port on that machine where rank 0's store listens.
        node_rank: which machine this is, ``0 … nnodes-1`` (torchrun's ``--node_rank``).
        nproc_per_node: processes on this machine (torchrun's ``--nproc_per_node``).
        nnodes: number of machines.
        source: which launcher the values came from (``"torchrun"``, ``"slurm"``, ``"openpai"``,
            or ``"manual"``).

    Example::

        >>> env = DistEnv(rank=5, local_rank=1, world_size=8, master_addr="10.0.0.1",
        ...               master_port=29500, node_rank=2, nproc_per_node=2, nnodes=4)
        >>> env.init_method
        'tcp://10.0.0.1:29500'
        >>> env.to_environ()["RANK"], env.to_environ()["LOCAL_RANK"]
        ('5', '1')

    .. warning::
        Old blog posts (and the seeds) call ``world_size`` "the number of machines" and ``rank``
        "the machine's index". With one process per GPU both count *processes*: 2 machines × 8
        GPUs is ``world_size=16``, and the machines' index is ``node_rank``.
    """

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    node_rank: int = 0
    nproc_per_node: int = 1
    nnodes: int = 1
    source: str = "manual"

    def __post_init__(self):
        check_int("world_size", self.world_size, 1)
        check_int("nproc_per_node", self.nproc_per_node, 1)
        check_int("nnodes", self.nnodes, 1)
        check_int("rank", self.rank, 0)
        check_int("local_rank", self.local_rank, 0)
        check_int("node_rank", self.node_rank, 0)
        check_int("master_port", self.master_port, 1)
        if self.rank >= self.world_size:
            raise ValueError(f"Invalid rank {self.rank}, rank should be in the interval "
                             f"[0, {self.world_size - 1}] (world_size={self.world_size} counts "
                             "processes, not machines)")
        if self.local_rank >= self.nproc_per_node:
            raise ValueError(f"Invalid local_rank {self.local_rank}, it should be in the interval "
                             f"[0, {self.nproc_per_node - 1}] (nproc_per_node={self.nproc_per_node})")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"Invalid node_rank {self.node_rank}, it should be in the interval "
                             f"[0, {self.nnodes - 1}] (nnodes={self.nnodes})")
        if self.master_port > 65535:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")
        if not isinstance(self.master_addr, str) or not self.master_addr.strip():
            raise ValueError(f"master_addr must be a non-empty host name or IP address, got "
                             f"{self.master_addr!r}")

    @property
    def init_method(self) -> str:
        """``tcp://master_addr:master_port`` — the URL form of the same rendezvous point."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr  # IPv6
        return f"tcp://{host}:{self.master_port}"

    def to_environ(self) -> dict[str, str]:
        """The variables torchrun would set for this process (what ``env://`` reads).

        Example::

            >>> DistEnv(0, 0, 2, "127.0.0.1", 29500, nproc_per_node=2).to_environ()["WORLD_SIZE"]
            '2'
        """
        return {
            "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
            "RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.nproc_per_node),
            "GROUP_RANK": str(self.node_rank), "GROUP_WORLD_SIZE": str(self.nnodes),
        }


def global_rank(node_rank: int, local_rank: int, nproc_per_node: int) -> int:
    """``node_rank × nproc_per_node + local_rank`` — the global rank of a process, with checks.

    This is the seeds' ``rank = args.nr * args.gpus + gpu`` (and OpenPAI's
    ``PAI_TASK_INDEX * gpus + gpu``). torchrun and SLURM compute it for you.

    Example::

        >>> global_rank(node_rank=3, local_rank=7, nproc_per_node=8)   # last GPU of 4 nodes x 8
        31
        >>> global_rank(1, 8, 8)
        Traceback (most recent call last):
        ...
        ValueError: local_rank must be in [0, 7] with nproc_per_node=8, got 8

    .. warning::
        Each machine must use the *same* ``nproc_per_node`` in this formula; with a mistake on one
        machine two processes get the same rank and the job hangs at initialisation.
    """
    check_int("node_rank", node_rank, 0)
    check_int("nproc_per_node", nproc_per_node, 1)
    check_int("local_rank", local_rank, 0)
    if local_rank >= nproc_per_node:
        raise ValueError(f"local_rank must be in [0, {nproc_per_node - 1}] with "
                         f"nproc_per_node={nproc_per_node}, got {local_rank}")
    return node_rank * nproc_per_node + local_rank


def rank_layout(nnodes: int, nproc_per_node: int) -> list[tuple[int, int, int]]:
    """Every process of a cluster as ``(rank, node_rank, local_rank)``, in rank order.

    ``len(rank_layout(n, k))`` is the world size ``n × k``.

    Example::

        >>> rank_layout(nnodes=2, nproc_per_node=3)
        [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2)]

    .. warning::
        Global ranks are numbered node by node, so ``rank // nproc_per_node`` is the node only
        when every node runs the same number of processes.
    """
    check_int("nnodes", nnodes, 1)
    check_int("nproc_per_node", nproc_per_node, 1)
    return [(global_rank(node, local, nproc_per_node), node, local)
            for node in range(nnodes) for local in range(nproc_per_node)]


# --------------------------------------------------------------------------------------------
# SLURM's compressed host lists: node[01-03,07] -> node01 node02 node03 node07
# --------------------------------------------------------------------------------------------

def _split_top_level(text: str, original: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"malformed SLURM node list {original!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"malformed SLURM node list {original!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"malformed SLURM node list {original!r}: '[' is never closed")
    parts.append(text[start:])
    return parts


def _expand_range_list(body: str, original: str) -> list[str]:
    out: list[str] = []
    for entry in body.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", entry)
        if m is None:
            raise ValueError(f"malformed SLURM node list {original!r}: {entry!r} inside [...] is "
                             "not a number or a range like 01-03")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"malformed SLURM node list {original!r}: range {lo}-{hi} runs "
                             "backwards")
        width = len(lo)  # SLURM keeps the zero padding of the first number: 08-10 -> 08 09 10
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list (``SLURM_JOB_NODELIST``) the way ``scontrol show hostnames`` does.

    Example::

        >>> expand_slurm_nodelist("node[01-03,07]")
        ['node01', 'node02', 'node03', 'node07']
        >>> expand_slurm_nodelist("gpu-a[8-10],login1")
        ['gpu-a8', 'gpu-a9', 'gpu-a10', 'login1']
        >>> expand_slurm_nodelist("rack[1-2]-n[1-2]")
        ['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']

    .. warning::
        Rank 0 runs on the *first* host of the list, so that is the master address — but only if
        its name resolves to an address the other nodes can reach (on some clusters the
        high-speed network has its own host names, e.g. ``node01-ib``).
    """
    if not isinstance(nodelist, str):
        raise TypeError(f"nodelist must be a str like 'node[01-03]', got {type(nodelist).__name__}")
    if not nodelist.strip():
        raise ValueError("SLURM node list is empty")
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip(), nodelist):
        item = item.strip()
        if not item:
            raise ValueError(f"malformed SLURM node list {nodelist!r}: empty host name")
        # pieces alternate: literal text, bracket body, literal text, ...
        pieces = re.split(r"\[([^\]]*)\]", item)
        choices = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                if "[" in piece or "]" in piece:
                    raise ValueError(f"malformed SLURM node list {nodelist!r}: unbalanced brackets")
                choices.append([piece])
            else:
                choices.append(_expand_range_list(piece, nodelist))
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def _expand_tasks_per_node(value: str) -> list[int]:
    """SLURM's ``SLURM_TASKS_PER_NODE`` format: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for entry in value.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", entry)
        if m is None:
            raise ValueError(f"SLURM_TASKS_PER_NODE={value!r} is malformed: expected entries like "
                             "'4' or '4(x2)'")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


# --------------------------------------------------------------------------------------------
# dist_env_from
# --------------------------------------------------------------------------------------------

class _Reader:
    """Reads variables from a mapping, naming every missing or malformed one."""

    def __init__(self, environ: Mapping[str, str], source: str):
        self.environ, self.source = environ, source

    def missing(self, names) -> list[str]:
        return [n for n in names if n not in self.environ or str(self.environ[n]).strip() == ""]

    def require(self, names, hint: str = "") -> None:
        """Raise naming every missing variable; a tuple in ``names`` is satisfied by any one of its
        alternatives (named as ``"A (or B)"`` when all are missing)."""
        missing = []
        for name in names:
            options = name if isinstance(name, tuple) else (name,)
            if len(self.missing(options)) == len(options):
                missing.append(options[0] + "".join(f" (or {o})" for o in options[1:]))
        if missing:
            raise ValueError(f"{self.source} environment is missing {', '.join(missing)}"
                             + (f"; {hint}" if hint else ""))

    def int(self, name: str) -> int:
        raw = str(self.environ[name]).strip()
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer") from None

    def get_int(self, name: str) -> int | None:
        return None if self.missing([name]) else self.int(name)


def _merge(name: str, from_env: int | None, from_arg: int | None, env_name: str,
           hint: str, source: str) -> int:
    """A value from the environment, or else from a keyword argument; both must agree."""
    if from_arg is not None:
        check_int(name, from_arg, 1 if name in ("nproc_per_node", "nnodes") else 0)
    if from_env is not None and from_arg is not None and from_env != from_arg:
        raise ValueError(f"{name}={from_arg} contradicts {env_name}={from_env} in the environment; "
                         f"drop the {name} argument or fix the launcher")
    value = from_env if from_env is not None else from_arg
    if value is None:
        raise ValueError(f"{source} environment is missing {env_name}; {hint}")
    return value


def _port(reader: _Reader, name: str) -> int:
    port = reader.int(name)
    if not 1 <= port <= 65535:
        raise ValueError(f"{name}={port} is not a TCP port; expected 1-65535")
    return port


def _from_torchrun(r: _Reader, local_rank, nproc_per_node, nnodes) -> DistEnv:
    r.require(("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
              "torchrun sets them all; with a hand-written env:// setup export "
              "MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE")
    rank, world_size = r.int("RANK"), r.int("WORLD_SIZE")
    local = _merge("local_rank", r.get_int("LOCAL_RANK"), local_rank, "LOCAL_RANK",
                   "pass local_rank= (the GPU index of this process)", "torchrun")
    nproc = _merge("nproc_per_node", r.get_int("LOCAL_WORLD_SIZE"), nproc_per_node,
                   "LOCAL_WORLD_SIZE", "pass nproc_per_node= (processes on each machine)",
                   "torchrun")
    node = r.get_int("GROUP_RANK")
    if node is None:
        node = (rank - local) // nproc
    env_nnodes = r.get_int("GROUP_WORLD_SIZE")
    if env_nnodes is None and nnodes is None:
        if world_size % nproc:
            raise ValueError(f"WORLD_SIZE={world_size} is not a multiple of nproc_per_node={nproc} "
                             "and GROUP_WORLD_SIZE is not set; pass nnodes=")
        env_nnodes = world_size // nproc
    n = _merge("nnodes", env_nnodes, nnodes, "GROUP_WORLD_SIZE", "pass nnodes=", "torchrun")
    return DistEnv(rank, local, world_size, str(r.environ["MASTER_ADDR"]).strip(),
                   _port(r, "MASTER_PORT"), node, nproc, n, "torchrun")


def _from_slurm(r: _Reader, local_rank, nproc_per_node, nnodes) -> DistEnv:
    e = r.environ
    # the task count: SLURM_NTASKS, or its older alias SLURM_NPROCS
    r.require(("SLURM_PROCID", "SLURM_LOCALID", ("SLURM_NTASKS", "SLURM_NPROCS"), "SLURM_NODEID"),
              "run the script with srun inside the allocation (sbatch alone starts one process)")
    ntasks_name = "SLURM_NTASKS" if not r.missing(["SLURM_NTASKS"]) else "SLURM_NPROCS"
    rank, node, world_size = r.int("SLURM_PROCID"), r.int("SLURM_NODEID"), r.int(ntasks_name)
    local = _merge("local_rank", r.int("SLURM_LOCALID"), local_rank, "SLURM_LOCALID", "", "SLURM")
    # tasks on *this* node: SLURM_TASKS_PER_NODE lists every node ("2(x3),1")
    env_nproc = None
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if not r.missing([name]):
            counts = _expand_tasks_per_node(str(e[name]))
            if node >= len(counts):
                raise ValueError(f"SLURM_NODEID={node} but {name}={e[name]!r} lists only "
                                 f"{len(counts)} node(s)")
            env_nproc = counts[node]
            break
    if env_nproc is None:
        env_nproc = r.get_int("SLURM_NTASKS_PER_NODE")
    nproc = _merge("nproc_per_node", env_nproc, nproc_per_node, "SLURM_TASKS_PER_NODE",
                   "pass nproc_per_node= or use srun --ntasks-per-node", "SLURM")
    env_nnodes = r.get_int("SLURM_NNODES")
    if env_nnodes is None:
        env_nnodes = r.get_int("SLURM_JOB_NUM_NODES")
    n = _merge("nnodes", env_nnodes, nnodes, "SLURM_NNODES", "pass nnodes=", "SLURM")
    # master address: an explicit MASTER_ADDR wins, else the first host of the node list
    if not r.missing(["MASTER_ADDR"]):
        addr = str(e["MASTER_ADDR"]).strip()
    else:
        names = [v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                 if not r.missing([v])]
        if not names:
            raise ValueError("SLURM environment is missing MASTER_ADDR and SLURM_JOB_NODELIST: "
                             "cannot tell where rank 0 runs; export MASTER_ADDR in the batch script")
        addr = expand_slurm_nodelist(str(e[names[0]]))[0]
    # master port: an explicit MASTER_PORT wins, else one derived from the job id, the same on
    # every node of the job and different for jobs that share a node
    if not r.missing(["MASTER_PORT"]):
        port = _port(r, "MASTER_PORT")
    elif not r.missing(["SLURM_JOB_ID"]):
        port = 15000 + r.int("SLURM_JOB_ID") % 10000
    else:
        raise ValueError("SLURM environment is missing MASTER_PORT and SLURM_JOB_ID; export "
                         "MASTER_PORT=<a free port> in the batch script")
    return DistEnv(rank, local, world_size, addr, port, node, nproc, n, "slurm")


def _from_openpai(r: _Reader, local_rank, nproc_per_node, nnodes) -> DistEnv:
    r.require(_PAI, "OpenPAI sets them for a job whose first task role is called 'worker' and "
                    "declares a port named 'SynPort'")
    node = r.int("PAI_TASK_INDEX")
    local = _merge("local_rank", r.get_int("LOCAL_RANK"), local_rank, "LOCAL_RANK",
                   "pass local_rank= (the index mp.spawn gives each process)", "OpenPAI")
    nproc = _merge("nproc_per_node", r.get_int("LOCAL_WORLD_SIZE"), nproc_per_node,
                   "LOCAL_WORLD_SIZE", "pass nproc_per_node= (the seeds' --gpus)", "OpenPAI")
    n = _merge("nnodes", r.get_int("PAI_TASK_ROLE_TASK_COUNT_worker"), nnodes,
               "PAI_TASK_ROLE_TASK_COUNT_worker", "pass nnodes= (the seeds' --nodes)", "OpenPAI")
    if local >= nproc:
        raise ValueError(f"Invalid local_rank {local}, it should be in the interval "
                         f"[0, {nproc - 1}] (nproc_per_node={nproc})")
    return DistEnv(global_rank(node, local, nproc), local, n * nproc,
                   str(r.environ["PAI_HOST_IP_worker_0"]).strip(),
                   _port(r, "PAI_worker_0_SynPort_PORT"), node, nproc, n, "openpai")


def dist_env_from(environ: Mapping[str, str] | None = None, *, local_rank: int | None = None,
                  nproc_per_node: int | None = None, nnodes: int | None = None) -> DistEnv:
    """Read this process's rank, world size and master address from a launcher's variables.

    Recognises, in this order (the first whose key variable is present wins):

    1. **torchrun** (``RANK`` present): ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
       ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``,
       ``MASTER_PORT``. Under ``srun torchrun …`` torchrun's values describe the process, so they
       win over SLURM's.
    2. **SLURM** (``SLURM_PROCID`` present): ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``,
       ``SLURM_NODEID``, ``SLURM_TASKS_PER_NODE``, ``SLURM_NNODES``; the master address is
       ``MASTER_ADDR`` if set, else the first host of ``SLURM_JOB_NODELIST``; the port is
       ``MASTER_PORT`` if set, else ``15000 + SLURM_JOB_ID % 10000``.
    3. **OpenPAI** (``PAI_TASK_INDEX`` present), as in the seeds: the node is ``PAI_TASK_INDEX``,
       the master is ``PAI_HOST_IP_worker_0:PAI_worker_0_SynPort_PORT``, and
       ``rank = PAI_TASK_INDEX × nproc_per_node + local_rank``.

    Args:
        environ: the variables to read; ``None`` reads ``os.environ``. Nothing else is read.
        local_rank: this process's index on its machine, when the launcher does not set it (the
            seeds' ``mp.spawn`` index under OpenPAI). Must agree with the environment if both exist.
        nproc_per_node: processes per machine, when the launcher does not say (the seeds' ``--gpus``).
        nnodes: number of machines, when the launcher does not say (the seeds' ``--nodes``).

    Returns:
        a :class:`DistEnv`.

    Raises:
        ValueError: a needed variable is missing (it is named), malformed, or contradicts an argument.

    Example::

        >>> env = dist_env_from({"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16",
        ...                      "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "4(x4)",
        ...                      "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "node[01-03,07]",
        ...                      "SLURM_JOB_ID": "4242"})
        >>> env.rank, env.local_rank, env.node_rank, env.world_size, env.init_method
        (9, 1, 2, 16, 'tcp://node01:19242')
        >>> pai = {"PAI_TASK_INDEX": "2", "PAI_HOST_IP_worker_0": "10.0.0.1",
        ...        "PAI_worker_0_SynPort_PORT": "29500"}
        >>> dist_env_from(pai, local_rank=3, nproc_per_node=8, nnodes=4).rank   # 2 * 8 + 3
        19
        >>> dist_env_from({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
        Traceback (most recent call last):
        ...
        ValueError: torchrun environment is missing MASTER_PORT; torchrun sets them all; with a hand-written env:// setup export MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE

    .. warning::
        Under OpenPAI and with hand-written ``env://`` setups, nothing checks that every machine
        computed its ranks with the same ``nproc_per_node``: two processes with one rank hang the
        job at initialisation. Prefer torchrun (or ``srun``), which hand out ranks themselves.
    """
    if environ is None:
        environ = os.environ
    if not isinstance(environ, Mapping):
        raise TypeError(f"environ must be a mapping of variable names to strings (or None for "
                        f"os.environ), got {type(environ).__name__}")
    if "RANK" in environ:
        return _from_torchrun(_Reader(environ, "torchrun"), local_rank, nproc_per_node, nnodes)
    if "SLURM_PROCID" in environ:
        return _from_slurm(_Reader(environ, "SLURM"), local_rank, nproc_per_node, nnodes)
    if "PAI_TASK_INDEX" in environ:
        return _from_openpai(_Reader(environ, "OpenPAI"), local_rank, nproc_per_node, nnodes)
    raise ValueError(
        "no distributed launcher variables found: expected torchrun's "
        f"({', '.join(_TORCHRUN)}), SLURM's ({', '.join(_SLURM)}) or OpenPAI's "
        f"({', '.join(_PAI)}). Start the script with torchrun or srun, or pass environ=")
