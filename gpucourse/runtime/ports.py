"""Where the ranks meet: the key-value store :func:`~gpucourse.launch` hosts, on loopback only.

``torch.distributed.TCPStore(host, port, is_master=True)`` listens on *every* interface of the
machine (``ss -ltn`` shows ``*:PORT``), unauthenticated: anyone on the network could write keys
into a running job. A launch only ever talks to its own machine, so the store here listens on
``127.0.0.1`` alone: :func:`listen_on` binds the socket itself and hands it to the store
(``TCPStore(..., master_listen_fd=fd)``).

:func:`free_port` is for the other case — a port that some process will bind *later*.
"""

from __future__ import annotations

import datetime
import random
import socket

__all__ = ["free_port", "host_store", "listen_on"]


def listen_on(host: str, port: int) -> int:
    """A TCP socket listening on exactly ``host:port`` (``port=0``: one the OS picks).

    Returns the socket's file descriptor, to pass as ``TCPStore(..., master_listen_fd=fd)``; the
    store owns it from then on and closes it when the store is destroyed.

    Example::

        >>> import os, socket
        >>> fd = listen_on("127.0.0.1", 0)
        >>> s = socket.socket(fileno=fd)
        >>> s.getsockname()[0]
        '127.0.0.1'
        >>> s.close()
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own server does
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


def host_store(timeout: float):
    """The launcher's store: a ``TCPStore`` server on ``127.0.0.1``, on a port the OS picks.

    Binding port 0 and keeping it bound means no other process can take the port between the
    choice and the use (a port chosen first and bound later by rank 0 can be: ``EADDRINUSE``).
    Read the port from ``store.port``.
    """
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         master_listen_fd=listen_on("127.0.0.1", 0),
                         timeout=datetime.timedelta(seconds=timeout))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now, for a store some process will bind later.

    The port is picked at random *outside* the kernel's ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``, usually 32768-60999). Asking the OS for "port 0"
    would return a port from that range, and between this call and the moment rank 0 binds it, any
    process on the machine (a gloo connection, another job's store) may be handed the same port
    by the OS — ``EADDRINUSE``. Ports below the range are never handed out that way. If the range
    leaves no room, it falls back to asking the OS.

    Example::

        >>> port = free_port()
        >>> 1024 <= port <= 65535
        True
    """
    lo, hi = _ephemeral_range()
    pool = [(a, b) for a, b in ((20000, min(lo, 65536) - 1), (max(hi, 20000) + 1, 65535)) if b > a + 100]
    rng = random.SystemRandom()
    for _ in range(64 if pool else 0):
        a, b = rng.choice(pool)
        port = rng.randint(a, b)
        if 29400 <= port <= 29600:  # torchrun's default 29500 and neighbours: leave them to others
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    """The range the kernel takes ports from for ``bind(port 0)`` and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 65535  # the IANA range, which macOS and Windows use


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), if any.

    Ranks set ``GLOO_SOCKET_IFNAME`` to it (unless already set), so gloo's own connections listen
    on loopback too instead of on the address the machine's host name resolves to.
    """
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # pragma: no cover - platforms without if_nameindex
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None
