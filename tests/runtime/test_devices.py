import pytest
import torch
from hypothesis import given, strategies as st

import gpucourse as gc


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
