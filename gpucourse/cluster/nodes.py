"""Several "machines" on one host: one launcher per emulated node, exactly as on a real cluster.

On a cluster you start the same command on every machine, and only the node's index differs::

    # machine 0 (10.0.0.1)                                  # machine 1
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 \\   torchrun --nnodes=2 --node_rank=1 ...
             --master_addr=10.0.0.1 --master_port=29500 train.py

:func:`launch_nodes` does the same on one host: one ``python -m torch.distributed.run`` (torchrun)
subprocess per node, all pointing at ``127.0.0.1``. The processes really rendezvous, get their
ranks from torchrun and all-reduce over TCP — only the wire is loopback instead of a network.
It can also play SLURM's ``srun`` (one process per task, ``SLURM_*`` variables) and OpenPAI (the
seeds' recipe: one command per node, ``PAI_*`` variables, the script spawns its own processes).

Every node's output is captured and shown grouped by node and rank; a node that fails or a job that
does not finish within ``timeout`` seconds stops everything (each node runs in its own session, and
its whole process group is killed) and raises with the nodes' output.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..runtime import free_port
from ..runtime import check_int

__all__ = ["NodeError", "NodeResult", "launch_nodes", "torchrun_command"]

_LAUNCHERS = ("torchrun", "srun", "openpai")
_PREFIX = re.compile(r"^\[rank (\d+)\] ?")


@dataclass
class NodeResult:
    """What one emulated node did (returned by :func:`launch_nodes`).

    Example::

        >>> r = NodeResult(1, [["python", "x.py"]], 0, "[rank 2] hello\\n[rank 3] hi\\n")
        >>> r.lines = _group_lines(r.stdout, None)
        >>> r.by_rank()
        {2: ['hello'], 3: ['hi']}

    .. warning::
        ``stdout`` interleaves the lines of the node's processes in the order they were written;
        use :meth:`by_rank` for a deterministic view.

    Attributes:
        node_rank: the node's index.
        commands: the command line(s) started for this node (one for torchrun/OpenPAI, one per
            task for srun).
        returncode: exit status (0 = success; negative = killed by that signal; ``None`` = still
            running when it was stopped).
        stdout, stderr: everything the node printed.
    """

    node_rank: int
    commands: list[list[str]]
    returncode: int | None
    stdout: str
    stderr: str = ""
    lines: dict[int, list[str]] = field(default_factory=dict, repr=False)

    def by_rank(self) -> dict[int, list[str]]:
        """The node's stdout lines grouped by global rank (``[rank r]`` prefixes removed)."""
        return {r: list(v) for r, v in sorted(self.lines.items())}


class NodeError(RuntimeError):
    """An emulated node exited with an error; ``.node_rank`` names it, ``.results`` holds all nodes.

    The message shows the first traceback printed by one of the node's processes — usually the
    root cause; the other nodes were stopped because of it.

    Example::

        >>> err = NodeError("node 1 failed", 1, [])
        >>> isinstance(err, RuntimeError), err.node_rank
        (True, 1)
    """

    def __init__(self, message: str, node_rank: int, results: list[NodeResult]):
        super().__init__(message)
        self.node_rank = node_rank
        self.results = results


def torchrun_command(script: str, *, nnodes: int, node_rank: int, nproc_per_node: int,
                     master_addr: str, master_port: int, script_args: Sequence[str] = (),
                     python: str | None = None) -> list[str]:
    """The torchrun command line for one node of a static multi-node job.

    Example::

        >>> cmd = torchrun_command("train.py", nnodes=2, node_rank=1, nproc_per_node=8,
        ...                        master_addr="10.0.0.1", master_port=29500, python="python")
        >>> print(" ".join(cmd))
        python -m torch.distributed.run --nnodes=2 --node_rank=1 --nproc_per_node=8 --master_addr=10.0.0.1 --master_port=29500 train.py

    .. warning::
        Every node must get the same command except ``--node_rank``. A different ``--nnodes``,
        ``--nproc_per_node``, ``--master_addr`` or ``--master_port`` on one machine makes the
        others wait at the rendezvous until it times out. You may read
        ``python -m torch.distributed.launch … --local_rank`` — today that launcher is deprecated:
        ``torchrun`` (this module) sets ``LOCAL_RANK`` in the environment instead.
    """
    _check_layout(nnodes, nproc_per_node)
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be an int in [0, {nnodes - 1}], got {node_rank!r}")
    return [python or sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--node_rank={node_rank}", f"--nproc_per_node={nproc_per_node}",
            f"--master_addr={master_addr}", f"--master_port={master_port}", str(script),
            *map(str, script_args)]


def _check_layout(nnodes, nproc_per_node):
    for name, value in (("nnodes", nnodes), ("nproc_per_node", nproc_per_node)):
        check_int(name, value, 1)


def _kill_groups(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every process group (torchrun forwards it to its workers), then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)  # also reaps workers whose leader already exited
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)


def _group_lines(text: str, default_rank: int | None) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = _PREFIX.match(line)
        if m:
            out.setdefault(int(m.group(1)), []).append(line[m.end():])
        elif default_rank is not None:
            out.setdefault(default_rank, []).append(line)
        else:
            out.setdefault(-1, []).append(line)  # the launcher's own lines
    return out


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _root_cause(stderr: str, lines: int = 25) -> str:
    """The first rank's traceback in a node's stderr, else the stderr's last lines.

    torchrun's own report (``ChildFailedError`` …) comes after the workers' tracebacks and says
    little; the worker that raised first is what a learner needs to see.
    """
    by_rank = _group_lines(stderr, None)
    for rank in sorted(r for r in by_rank if r >= 0):
        text = "\n".join(by_rank[rank])
        if "Traceback" in text or re.search(r"error", text, re.IGNORECASE):   # argparse: "…: error: …"
            return f"[rank {rank}] " + _tail(text[text.find("Traceback"):] if "Traceback" in text
                                             else text, lines).replace("\n", f"\n[rank {rank}] ")
    return _tail(stderr, lines)


def launch_nodes(script: str, nnodes: int = 2, nproc_per_node: int = 1, *,
                 script_args: Sequence[str] = (), launcher: str = "torchrun",
                 master_addr: str = "127.0.0.1", master_port: int | None = None,
                 timeout: float = 120.0, env: Mapping[str, str] | None = None,
                 node_env: Sequence[Mapping[str, str]] | None = None,
                 node_prefix: Sequence[Sequence[str]] | None = None,
                 check: bool = True, echo: bool = True) -> list[NodeResult]:
    """Run ``script`` as a job of ``nnodes`` emulated machines × ``nproc_per_node`` processes.

    Args:
        script: path of the Python script every process runs.
        nnodes: number of emulated machines (one launcher each).
        nproc_per_node: processes per machine (one per GPU on a real cluster).
        script_args: arguments after the script name (the same on every node).
        launcher: ``"torchrun"`` — one ``python -m torch.distributed.run --nnodes … --node_rank=i``
            per node; ``"srun"`` — what ``srun`` does: one ``python script`` per task with
            ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NODEID``/… set; ``"openpai"`` — one
            ``python script`` per node with ``PAI_TASK_INDEX``, ``PAI_HOST_IP_worker_0``,
            ``PAI_worker_0_SynPort_PORT`` and ``PAI_TASK_ROLE_TASK_COUNT_worker`` set (the script
            starts its own ``nproc_per_node`` processes, as in the seeds).
        master_addr: address of node 0, where rank 0's store listens.
        master_port: port for it; ``None`` picks a free one.
        timeout: seconds for the whole job; then every node is stopped and ``TimeoutError`` raised.
        env: extra variables for every node (e.g. ``{"GLOO_SOCKET_IFNAME": "eth0"}``).
        node_env: extra variables per node (a list of ``nnodes`` mappings).
        node_prefix: a command prefix per node, e.g. ``["ip", "netns", "exec", "host1"]`` to run
            the node inside a network namespace.
        check: raise :class:`NodeError` if a node fails (else just return the results).
        echo: print each node's output, grouped by node and rank.

    Returns:
        one :class:`NodeResult` per node, in node order.

    Example (the script prints its rank and all-reduces)::

        >>> import gpucourse as gc, pathlib
        >>> script = pathlib.Path(gc.__file__).parents[1] / "scripts" / "whoami_allreduce.py"
        >>> res = launch_nodes(str(script), nnodes=2, nproc_per_node=1, echo=False)
        >>> [r.returncode for r in res], sorted(res[1].by_rank())
        ([0, 0], [1])

    .. warning::
        The nodes share this host's CPU cores and talk over loopback, so this shows how a
        multi-node job is *started* and that it is *correct*, not how fast a network is. Each node
        imports torch in fresh interpreters: expect several seconds of start-up.
    """
    _check_layout(nnodes, nproc_per_node)
    if launcher not in _LAUNCHERS:
        raise ValueError(f"launcher must be one of {_LAUNCHERS}, got {launcher!r}")
    if not os.path.isfile(script):
        raise FileNotFoundError(f"script {script!r} does not exist (cwd: {os.getcwd()})")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    for name, seq in (("node_env", node_env), ("node_prefix", node_prefix)):
        if seq is not None and len(seq) != nnodes:
            raise ValueError(f"{name} must have one entry per node ({nnodes}), got {len(seq)}")
    port = free_port() if master_port is None else master_port
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"master_port must be an int in [1, 65535], got {master_port!r}")

    base_env = dict(os.environ)
    # the scripts import gpucourse: make the package importable wherever they run
    package_root = str(pathlib.Path(__file__).resolve().parents[2])  # the folder holding gpucourse/
    base_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, base_env.get("PYTHONPATH", "")) if p)
    base_env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun would set (and warn about)
    base_env["PYTHONUNBUFFERED"] = "1"
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT"):  # never leak our own process's identity
        base_env.pop(key, None)
    base_env.update(env or {})
    gpus = _gpus_per_node(nnodes, nproc_per_node, env, node_env)

    procs: list[subprocess.Popen] = []
    owners: list[int] = []        # node of each process
    local_ranks: list[int | None] = []
    commands: list[list[list[str]]] = [[] for _ in range(nnodes)]
    with tempfile.TemporaryDirectory(prefix="gpucourse-nodes-") as tmp:
        files = []
        try:
            for node in range(nnodes):
                node_environ = {**base_env, **gpus[node], **(node_env[node] if node_env else {})}
                prefix = list(node_prefix[node]) if node_prefix else []
                jobs = _node_jobs(launcher, script, script_args, node, nnodes, nproc_per_node,
                                  master_addr, port, tmp)
                for local, cmd, extra in jobs:
                    out_path = os.path.join(tmp, f"node{node}-{len(procs)}.out")
                    err_path = os.path.join(tmp, f"node{node}-{len(procs)}.err")
                    out, err = open(out_path, "wb"), open(err_path, "wb")  # noqa: SIM115
                    files.append((out_path, err_path, out, err))
                    commands[node].append(prefix + cmd)
                    procs.append(subprocess.Popen(
                        prefix + cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                        env={**node_environ, **extra}, start_new_session=True))
                    owners.append(node)
                    local_ranks.append(local)
            failed, timed_out = _wait(procs, owners, timeout)
            finished = [p.poll() for p in procs]  # None: still running, about to be stopped
        except BaseException:  # KeyboardInterrupt (the notebook's stop button) among others
            _kill_groups(procs, grace=1.0)
            raise
        finally:
            _kill_groups(procs, grace=2.0)
            for *_, out, err in files:
                out.close()
                err.close()
        texts = [(_read(o), _read(e)) for o, e, *_ in files]

    results = []
    for node in range(nnodes):
        idx = [i for i, n in enumerate(owners) if n == node]
        codes = [finished[i] for i in idx]
        code = next((c for c in codes if c not in (0, None)), None if None in codes else 0)
        lines: dict[int, list[str]] = {}
        stdout, stderr = [], []
        for i in idx:
            out, err = texts[i]
            stdout.append(out)
            stderr.append(err)
            default = None
            if local_ranks[i] is not None:
                default = node * nproc_per_node + local_ranks[i]
            for r, ls in _group_lines(out, default).items():
                lines.setdefault(r, []).extend(ls)
        results.append(NodeResult(node, commands[node], code, "".join(stdout), "".join(stderr),
                                  lines))
    if echo:
        _echo(results)
    if timed_out:
        raise TimeoutError(
            f"launch_nodes(): the job did not finish within {timeout:g} s; every node was stopped. "
            "Usual causes: nodes started with different --nnodes/--master_addr/--master_port, a "
            "node that never started, a collective that only some ranks call."
            + "".join(f"\n--- node {r.node_rank} (stderr, last lines) ---\n{_tail(r.stderr)}"
                      for r in results if r.stderr.strip()))
    if failed is not None and check:
        bad = results[failed]
        raise NodeError(f"node {failed} failed with exit code {bad.returncode}; every other node "
                        f"was stopped.\n--- node {failed}: first error ---\n{_root_cause(bad.stderr)}",
                        failed, results)
    return results


def _gpus_per_node(nnodes: int, nproc: int, env: Mapping[str, str] | None,
                   node_env: Sequence[Mapping[str, str]] | None) -> list[dict[str, str]]:
    """``CUDA_VISIBLE_DEVICES`` for each emulated machine: GPUs of its own, as real machines have.

    The emulated machines share this host's GPUs. A script that takes ``cuda:<LOCAL_RANK>`` would
    put rank 0 of every machine on the same GPU, where NCCL fails or hangs. So each machine gets
    its own ``nproc`` GPUs when the host has enough for every process, and none otherwise — its
    processes then run as on machines without GPUs (gloo, on the CPU), and one line says so. A
    ``CUDA_VISIBLE_DEVICES`` given in ``env`` or ``node_env`` is left as it is.
    """
    if "CUDA_VISIBLE_DEVICES" in (env or {}) or any("CUDA_VISIBLE_DEVICES" in e for e in node_env or ()):
        return [{} for _ in range(nnodes)]
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return [{} for _ in range(nnodes)]
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in spec.split(",") if x.strip()][:count] if spec else [str(i) for i in range(count)]
    if len(ids) >= nnodes * nproc:
        return [{"CUDA_VISIBLE_DEVICES": ",".join(ids[n * nproc:(n + 1) * nproc])} for n in range(nnodes)]
    print(f"gc.launch_nodes: {nnodes} emulated machines × {nproc} processes, but {count} CUDA GPU(s) on "
          "this host: no machine gets a GPU (CUDA_VISIBLE_DEVICES=''), so every process runs on the "
          "CPU over gloo, as on machines without GPUs")
    return [{"CUDA_VISIBLE_DEVICES": ""} for _ in range(nnodes)]


def _node_jobs(launcher, script, script_args, node, nnodes, nproc, master_addr, port, tmp):
    """``[(local_rank or None, command, extra env)]`` for one node."""
    py = sys.executable
    if launcher == "torchrun":
        cmd = torchrun_command(script, nnodes=nnodes, node_rank=node, nproc_per_node=nproc,
                               master_addr=master_addr, master_port=port,
                               script_args=script_args, python=py)
        # label every output line with its global rank; keep torchrun's logs in our temp dir. The
        # label goes in the environment: torch 2.11's torchrun reads it only from there (its
        # --log-line-prefix-template option is newer; 2.11 hands an unknown option to python, and
        # every rank exits with status 2)
        i = cmd.index(str(script))
        cmd[i:i] = ["--tee=3", f"--log-dir={os.path.join(tmp, f'torchrun-node{node}')}"]
        return [(None, cmd, {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank ${rank}] "})]
    if launcher == "srun":
        nodelist = f"node[{0:02d}-{nnodes - 1:02d}]" if nnodes > 1 else "node00"
        jobs = []
        for local in range(nproc):
            extra = {
                "SLURM_PROCID": str(node * nproc + local), "SLURM_LOCALID": str(local),
                "SLURM_NODEID": str(node), "SLURM_NTASKS": str(nnodes * nproc),
                "SLURM_NNODES": str(nnodes), "SLURM_TASKS_PER_NODE": f"{nproc}(x{nnodes})",
                "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": "4242",
                # the emulated host names do not resolve: say where node 0 really is
                "MASTER_ADDR": master_addr, "MASTER_PORT": str(port),
            }
            jobs.append((local, [py, str(script), *map(str, script_args)], extra))
        return jobs
    extra = {"PAI_TASK_INDEX": str(node), "PAI_HOST_IP_worker_0": master_addr,
             "PAI_worker_0_SynPort_PORT": str(port), "PAI_TASK_ROLE_TASK_COUNT_worker": str(nnodes)}
    return [(None, [py, str(script), *map(str, script_args)], extra)]


def _wait(procs, owners, timeout):
    """Wait for all; on the first failure give the others a moment, then stop them.

    Returns ``(node of the first failed process or None, timed_out)``.
    """
    deadline = time.monotonic() + timeout
    failed = None
    while True:
        codes = [p.poll() for p in procs]
        if failed is None:
            for i, c in enumerate(codes):
                if c not in (None, 0):
                    failed = owners[i]
                    deadline = min(deadline, time.monotonic() + 2.0)  # peers notice and exit
                    break
        if all(c is not None for c in codes):
            return failed, False
        if time.monotonic() >= deadline:
            return failed, failed is None
        time.sleep(0.05)


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


_RELAYED = re.compile(r"^\[rank (\d+)\] ?(.*)$")


def _echo(results: list[NodeResult]) -> None:
    """Print each node's output under its own heading, by rank.

    A line is shown under the node of the process that *printed* it. ``gc.print_ordered`` gathers
    every rank's text to rank 0, which prints it with its own ``[rank s]`` prefix: such a line is
    shown as ``[rank s, printed by rank 0]``, and a node whose ranks printed nothing themselves
    says so instead of showing an empty section.
    """
    for res in results:
        status = {0: "ok", None: "stopped"}.get(res.returncode, f"exit code {res.returncode}")
        print(f"── node {res.node_rank} ({status})")
        shown = 0
        for rank, lines in res.by_rank().items():
            for line in lines:
                if not line.strip():
                    continue
                shown += 1
                relayed = _RELAYED.match(line) if rank >= 0 else None
                if relayed and int(relayed.group(1)) != rank:
                    print(f"   [rank {relayed.group(1)}, printed by rank {rank}] {relayed.group(2)}")
                elif relayed:
                    print(f"   [rank {rank}] {relayed.group(2)}")
                else:
                    print(f"   [rank {rank}] {line}" if rank >= 0 else f"   {line}")
        if not shown:
            print("   (no output of its own: its ranks printed nothing, or only through rank 0)")
    sys.stdout.flush()
