import pytest
import torch
from hypothesis import given, strategies as st

import gpucourse as gc
import gpucourse.runtime.devices as devices_mod


@pytest.mark.parametrize("spec, expected", [
    ("0,3", {0: 0, 1: 3}),
    ("3,0", {0: 3, 1: 0}),
    (" 1 , 2 ", {0: 1, 1: 2}),
    ("", {}),
    ("-1", {}),
    ("2,-1,3", {0: 2}),
    ("7", {0: 7}),
])
def test_visible_devices(spec, expected):
    assert gc.visible_devices(spec) == expected


@pytest.mark.parametrize("spec, bad", [("0,a", "'a'"), ("0,,1", "''"), ("1.5", "'1.5'"),
                                       ("0,0", "twice"), ("GPU-1234", "UUID")])
def test_visible_devices_rejects_malformed_entries(spec, bad):
    with pytest.raises(ValueError, match=bad):
        gc.visible_devices(spec)


def test_visible_devices_type_error():
    with pytest.raises(TypeError):
        gc.visible_devices(3)


@given(st.lists(st.integers(0, 63), unique=True, max_size=8))
def test_visible_devices_renumbers_from_zero(ids):
    mapping = gc.visible_devices(",".join(map(str, ids)))
    assert list(mapping) == list(range(len(ids)))
    assert list(mapping.values()) == ids


def test_visible_devices_none_means_all():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert gc.visible_devices(None) == {i: i for i in range(n)}


@pytest.mark.parametrize("n", [1, 2, 5])
def test_virtual_devices_cpu(n):
    devs = gc.virtual_devices(n)
    assert len(devs) == n and len(set(devs)) == n
    if torch.cuda.device_count() < n:
        assert devs == [torch.device("cpu", i) for i in range(n)]
    else:
        assert all(d.type == "cuda" for d in devs)


@pytest.mark.parametrize("n, exc", [(0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)])
def test_virtual_devices_bad(n, exc):
    with pytest.raises(exc, match="n must be"):
        gc.virtual_devices(n)


def test_default_backend_matches_this_machine():
    import torch.distributed as dist
    expected = "nccl" if (torch.cuda.is_available() and dist.is_nccl_available()) else "gloo"
    assert gc.default_backend() == expected


@pytest.mark.parametrize("cuda, count, nccl, expected", [
    (False, 0, False, "gloo"), (False, 0, True, "gloo"), (True, 2, False, "gloo"),
    (True, 0, True, "gloo"), (True, 1, True, "nccl"), (True, 8, True, "nccl")])
def test_default_backend_decision(monkeypatch, cuda, count, nccl, expected):
    import torch.distributed as dist
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    assert gc.default_backend() == expected


@pytest.mark.parametrize("count, nprocs, expected", [
    (1, 1, "nccl"), (1, 2, "gloo"), (2, 2, "nccl"), (2, 3, "gloo"), (8, 3, "nccl")])
def test_default_backend_for_n_ranks_needs_a_gpu_per_rank(monkeypatch, capsys, count, nprocs, expected):
    # the lent H200: one GPU, and the lessons' 2-rank cells used to get "nccl" and fail
    import torch.distributed as dist
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(devices_mod, "_SAID", set())
    assert gc.default_backend(nprocs) == expected
    said = capsys.readouterr().out
    if expected == "gloo":
        assert f"{nprocs} ranks but {count} CUDA GPU(s)" in said and "use gloo, on the CPU" in said
        assert gc.default_backend(nprocs, say=False) == "gloo" and capsys.readouterr().out == ""
        assert gc.default_backend(nprocs) == "gloo" and capsys.readouterr().out == ""   # said once
    else:
        assert said == ""


def test_default_backend_without_cuda_says_nothing(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.default_backend(3) == "gloo" and capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="nprocs must be >= 1, got 0"):
        gc.default_backend(0)


def test_rank_device_follows_the_group_backend_not_the_hardware():
    import torch.distributed as dist

    def fn(rank, world):
        return str(gc.rank_device()), dist.get_backend()

    assert str(gc.rank_device()) == "cpu"
    assert gc.launch(fn, 2, backend=gc.default_backend(2), timeout=60) == (
        [("cpu", "gloo")] * 2 if gc.default_backend(2, say=False) == "gloo" else
        [("cuda:0", "nccl"), ("cuda:1", "nccl")])


def test_default_backend_runs_a_collective():
    import torch.distributed as dist

    def fn(rank, world):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return dist.get_backend(), t.item()

    backend = gc.default_backend()
    if backend != "gloo":
        pytest.skip("collective test is for the CPU backend")
    assert gc.launch(fn, 2, backend=backend, timeout=60) == [("gloo", 3.0), ("gloo", 3.0)]
