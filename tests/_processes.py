"""Helpers for tests that check no process is left behind, and what processes listen on."""

import ipaddress
import os
import time


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie counts as dead (its /proc state is 'Z' on Linux)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, seconds: float = 5.0) -> list[int]:
    """Wait up to ``seconds`` for every pid to end; return those still alive."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def _decode(hex_addr: str):
    raw = bytes.fromhex(hex_addr)
    # /proc/net/tcp{,6} print the address as 32-bit words in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    return ip.ipv4_mapped or ip if ip.version == 6 else ip


def listeners_of(pids) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket open in one of ``pids`` (Linux: reads /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:   # 0A: LISTEN
                    addr, port = cols[1].split(":")
                    found.append((str(_decode(addr)), int(port, 16)))
    return found


def parent_of(pid: int):
    """The parent pid of ``pid`` (from /proc), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return None


def children_of(pid: int) -> list[int]:
    """The live (not zombie) children of ``pid``, from /proc."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and parent_of(int(p)) == pid
            and alive(int(p))]


def comm(pid: int) -> str:
    """The process name (what ``ps -o comm`` shows), or "" once it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""
