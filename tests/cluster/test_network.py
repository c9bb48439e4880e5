"""Interfaces, and the emulated 1 Gbit/s link between two network namespaces (root only)."""

import json
import subprocess
from pathlib import Path

import pytest

import gpucourse as gc

ROOT = Path(__file__).resolve().parents[2]
OK, REASON = gc.netns_support()
needs_netns = pytest.mark.skipif(not OK, reason=f"no network namespaces here: {REASON}")


def test_interfaces_include_loopback():
    ifaces = gc.network_interfaces()
    assert ifaces.get("lo") == "127.0.0.1"


def _namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@needs_netns
def test_link_is_created_and_always_removed():
    with pytest.raises(KeyError):
        with gc.emulated_link(100) as link:
            assert link.namespaces[0] in _namespaces()
            out = subprocess.run(link.prefix(1) + ["ip", "-4", "addr", "show", link.interface],
                                 capture_output=True, text=True, check=True).stdout
            assert link.addresses[1] in out
            raise KeyError("boom")
    assert link.namespaces[0] not in _namespaces() and link.namespaces[1] not in _namespaces()


@needs_netns
def test_all_reduce_across_the_emulated_link_is_bandwidth_bound():
    """Two "hosts", one process each, torchrun across a 200 Mbit/s cable: 4 MB take ~ the model."""
    with gc.emulated_link(200) as link:
        res = gc.launch_nodes(str(ROOT / "scripts" / "allreduce_bench.py"), 2, 1,
                              script_args=["--sizes", str(4 << 20), "--repeats", "2"],
                              master_addr=link.addresses[0],
                              node_prefix=[link.prefix(0), link.prefix(1)],
                              env={"GLOO_SOCKET_IFNAME": link.interface}, timeout=90, echo=False)
    seconds = json.loads(res[0].by_rank()[0][-1])["seconds"][0]
    predicted = gc.ring_all_reduce_time(4 << 20, 2, 0.0, 8 / 200e6)   # 0.168 s
    assert 0.8 * predicted < seconds < 2.0 * predicted


def test_bad_arguments_are_rejected_before_touching_the_system():
    with pytest.raises(ValueError, match="rate_mbit"):
        with gc.emulated_link(0):
            pass
    with pytest.raises(ValueError, match="delay_ms"):
        with gc.emulated_link(1000, delay_ms=-1):
            pass
    with pytest.raises(ValueError, match="interface"):
        with gc.emulated_link(1000, interface="x" * 20):
            pass


def test_unsupported_machines_get_the_reason():
    if OK:
        pytest.skip("this machine supports network namespaces")
    with pytest.raises(RuntimeError, match="cannot emulate"):
        with gc.emulated_link(1000):
            pass
