"""The network between nodes: which interface to use, and a real slow link to try it on.

Between machines, gloo and NCCL talk over a network *interface*. A server often has several —
``lo`` (loopback), ``eth0`` (the office network), ``ib0`` (InfiniBand), ``docker0`` … — and the
library picks one by resolving the host name. When it picks the wrong one, ranks on different
machines cannot reach each other and the job hangs at start-up. The fix is to name the interface::

    export GLOO_SOCKET_IFNAME=eth0     # gloo
    export NCCL_SOCKET_IFNAME=eth0     # NCCL's bootstrap and TCP transport

:func:`network_interfaces` lists this machine's interfaces and addresses (what ``ip addr`` or the
seeds' ``ifconfig`` shows).

:func:`emulated_link` goes further where the machine allows it (Linux, root, ``ip`` and ``tc``):
it builds two *network namespaces* — two isolated network stacks on this host, each with its own
interface ``gcnet0`` — joined by a virtual cable whose bandwidth is capped with ``tc`` (1 Gbit/s by
default). Processes started inside them (``ip netns exec …``) are two "hosts" that can only talk
over that cable, so a 2-node all-reduce across it really pays for 1 Gbit/s Ethernet.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["EmulatedLink", "emulated_link", "netns_support", "network_interfaces"]

_NS_PREFIX = "gpucourse-"
_counter = itertools.count()


def _ipv4_of(name: str) -> str | None:
    """IPv4 address of an interface (Linux ``SIOCGIFADDR``), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def network_interfaces() -> dict[str, str | None]:
    """This machine's network interfaces and their IPv4 addresses (``None``: no IPv4 address).

    Pick the one whose address the *other* machines use to reach this one, and pass its name in
    ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``.

    Example::

        >>> ifaces = network_interfaces()
        >>> "lo" in ifaces or sys.platform != "linux"   # loopback: only this machine can use it
        True

    .. warning::
        ``lo`` (127.0.0.1) works for every process on one machine and for none on another. A
        multi-node job that silently picked it — or a ``docker0`` bridge — waits at start-up until
        its timeout.
    """
    return {name: _ipv4_of(name) for _, name in socket.if_nameindex()}


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def netns_support() -> tuple[bool, str]:
    """Can :func:`emulated_link` run here? Returns ``(ok, reason)``; the reason says what is missing.

    Example::

        >>> ok, reason = netns_support()
        >>> isinstance(ok, bool) and isinstance(reason, str)
        True
    """
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces are a Linux feature (this is {sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"the `{tool}` command is not installed (package iproute2)"
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root (this process is not root)"
    probe = f"{_NS_PREFIX}probe-{os.getpid()}"
    try:
        res = _run(["ip", "netns", "add", probe], check=False)
        if res.returncode != 0:
            return False, f"`ip netns add` is not permitted here: {res.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return True, "root, ip and tc are available"


@dataclass(frozen=True)
class EmulatedLink:
    """Two network namespaces ("hosts") joined by a rate-limited virtual cable (:func:`emulated_link`).

    Example::

        >>> link = EmulatedLink(("ns-a", "ns-b"), ("10.77.0.1", "10.77.0.2"), "gcnet0", 1000.0)
        >>> link.prefix(1)
        ['ip', 'netns', 'exec', 'ns-b']
        >>> link.launch_options()["env"]
        {'GLOO_SOCKET_IFNAME': 'gcnet0'}

    .. warning::
        Only valid inside the ``with emulated_link(...)`` block that created it: afterwards the
        namespaces no longer exist.

    Attributes:
        namespaces: the two namespace names.
        addresses: the IPv4 address of each host on the cable.
        interface: the interface name, the same in both hosts (``GLOO_SOCKET_IFNAME``).
        rate_mbit: the bandwidth cap in Mbit/s (each direction).
    """

    namespaces: tuple[str, str]
    addresses: tuple[str, str]
    interface: str
    rate_mbit: float

    def prefix(self, host: int) -> list[str]:
        """Command prefix that runs a program on ``host`` (0 or 1): ``ip netns exec <ns>``."""
        if host not in (0, 1):
            raise ValueError(f"host must be 0 or 1, got {host!r}")
        return ["ip", "netns", "exec", self.namespaces[host]]

    def launch_options(self, *, set_ifname: bool = True) -> dict:
        """Keyword arguments for :func:`~gpucourse.launch_nodes` that run node ``i`` on host ``i``.

        Node 0 (rank 0's store) is on host 0, so that host's address is the master address.
        ``set_ifname=False`` leaves out ``GLOO_SOCKET_IFNAME`` — to see what goes wrong without it.
        """
        env = {"GLOO_SOCKET_IFNAME": self.interface} if set_ifname else {}
        return {"master_addr": self.addresses[0], "node_prefix": [self.prefix(0), self.prefix(1)],
                "env": env}


def _remove_stale_namespaces() -> None:
    """Delete namespaces left by a gpucourse process that was killed before it cleaned up."""
    res = _run(["ip", "netns", "list"], check=False)
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(re.escape(_NS_PREFIX) + r"(\d+)-\d+-[ab]", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _run(["ip", "netns", "del", name], check=False)


@contextlib.contextmanager
def emulated_link(rate_mbit: float = 1000.0, delay_ms: float = 0.0,
                  interface: str = "gcnet0") -> Iterator[EmulatedLink]:
    """Two "hosts" (network namespaces) joined by a cable limited to ``rate_mbit`` Mbit/s.

    Args:
        rate_mbit: bandwidth cap per direction (``tc`` token bucket); 1000 = 1 GbE.
        delay_ms: extra one-way latency (``tc netem``), 0 for none.
        interface: name of the cable's end inside each host.

    Yields:
        an :class:`EmulatedLink`. The namespaces (and the cable) are deleted when the ``with``
        block ends, whatever happens inside it.

    Raises:
        RuntimeError: the machine does not allow it (the message gives :func:`netns_support`'s
            reason).

    Example::

        >>> ok, _ = netns_support()
        >>> if ok:
        ...     with emulated_link(1000) as link:     # then: launch_nodes(..., **link.launch_options())
        ...         print(link.interface, link.addresses)
        ... else:
        ...     print("gcnet0 ('10.77.0.1', '10.77.0.2')")
        gcnet0 ('10.77.0.1', '10.77.0.2')

    .. warning::
        Both hosts still share this machine's CPU cores and memory; only the network between them
        is slow. Latency inside the cable is microseconds unless ``delay_ms`` adds some.
    """
    if isinstance(rate_mbit, bool) or not isinstance(rate_mbit, (int, float)) or not rate_mbit > 0:
        raise ValueError(f"rate_mbit must be a positive number of Mbit/s, got {rate_mbit!r}")
    if isinstance(delay_ms, bool) or not isinstance(delay_ms, (int, float)) or delay_ms < 0:
        raise ValueError(f"delay_ms must be a number >= 0, got {delay_ms!r}")
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]{0,14}", interface):
        raise ValueError(f"interface must be a Linux interface name (<= 15 characters), "
                         f"got {interface!r}")
    ok, reason = netns_support()
    if not ok:
        raise RuntimeError(f"cannot emulate a network link on this machine: {reason}")
    _remove_stale_namespaces()
    tag = f"{os.getpid()}-{next(_counter)}"
    ns = (f"{_NS_PREFIX}{tag}-a", f"{_NS_PREFIX}{tag}-b")
    veth = (f"gcv{tag}a"[-15:], f"gcv{tag}b"[-15:])
    addrs = ("10.77.0.1", "10.77.0.2")

    def cleanup():
        for name in ns:  # deleting a namespace deletes its end of the cable, and so the cable
            _run(["ip", "netns", "del", name], check=False)
        _run(["ip", "link", "del", veth[0]], check=False)  # if it never left the root namespace

    try:
        for name in ns:
            _run(["ip", "netns", "add", name])
        _run(["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]])
        for host in (0, 1):
            n = ns[host]
            _run(["ip", "link", "set", veth[host], "netns", n])
            _run(["ip", "-n", n, "link", "set", veth[host], "name", interface])
            _run(["ip", "-n", n, "addr", "add", f"{addrs[host]}/24", "dev", interface])
            _run(["ip", "-n", n, "link", "set", interface, "up"])
            _run(["ip", "-n", n, "link", "set", "lo", "up"])
            # cap what leaves each end: a token bucket at rate_mbit (burst ~ 1 ms of traffic)
            burst = max(int(rate_mbit * 1e6 / 8 / 1000), 64 * 1024)
            if delay_ms > 0:
                _run(["ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", interface, "root",
                      "handle", "1:", "netem", "delay", f"{delay_ms}ms"])
                parent = ["parent", "1:1", "handle", "10:"]
            else:
                parent = ["root"]
            _run(["ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", interface, *parent,
                  "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"])
    except subprocess.CalledProcessError as e:
        cleanup()
        raise RuntimeError(f"setting up the emulated link failed at `{' '.join(e.cmd)}`: "
                           f"{(e.stderr or '').strip()}") from None
    except BaseException:  # KeyboardInterrupt among others: never leave namespaces behind
        cleanup()
        raise
    try:
        yield EmulatedLink(ns, addrs, interface, float(rate_mbit))
    finally:
        cleanup()
