"""Every case of a check starts from its own seed, and seeding it costs no walk over the call stack.

Before CUDA (XPU, MTIA) starts, ``torch.manual_seed`` records its caller's stack three times, to seed
those devices when they do; a check seeds every case, and in a test run that was half of the pytest
workers' own time in the mutation tests. Where only the CPU can start, a case seeds the CPU's
generator alone.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from gpucourse.grading import harness, wire


def draw(n):
    return (torch.rand(n), torch.randn(n, dtype=torch.float64), torch.randint(0, 1000, (n,)),
            random.random(), float(np.random.rand()))


def plain(case):
    return [v.tolist() if isinstance(v, torch.Tensor) else v for v in case]


def values(nodes):
    return [plain(case) for case in wire.loads(wire.pack(nodes))]


@pytest.mark.skipif(torch.cuda.device_count() > 0,
                    reason="a machine with CUDA seeds through torch.manual_seed")
def test_a_case_draws_what_torch_manual_seed_gives_and_no_stack_is_recorded(monkeypatch):
    seeds = [7, 2**40 + 3, 0, 7]
    expected = []
    for seed in seeds:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed & 0xFFFFFFFF)
        expected.append(plain(draw(4)))
    calls = []
    monkeypatch.setattr(torch, "manual_seed", lambda seed: calls.append(seed))
    got = values(harness.run_cases(draw, [4] * len(seeds), seeds))
    assert got == expected
    assert got[0] == got[3] and got[0] != got[1]
    assert calls == []                    # the CPU's generator alone: no stack walked for other devices


def test_where_a_gpu_could_start_a_case_is_seeded_by_torch_manual_seed(monkeypatch):
    calls = []
    original = torch.manual_seed
    monkeypatch.setattr(torch, "manual_seed", lambda seed: (calls.append(seed), original(seed))[1])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    got = values(harness.run_cases(draw, [3, 3], [11, 12]))
    assert calls == [11, 12]
    original(11)
    assert got[0][0] == torch.rand(3).tolist()


def test_a_torch_without_the_device_queries_is_seeded_by_torch_manual_seed(monkeypatch):
    monkeypatch.delattr(torch.mtia, "_is_compiled")
    assert harness._only_the_cpu_can_start(torch) is False
