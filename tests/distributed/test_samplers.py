"""gc.DistributedSampler yields exactly torch.utils.data.DistributedSampler's indices."""

import warnings

import pytest
import torch
import torch.utils.data as tud
from hypothesis import given, settings
from hypothesis import strategies as st

import gpucourse as gc


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 200), num_replicas=st.integers(1, 9), data=st.data(),
       shuffle=st.booleans(), seed=st.integers(0, 2**31), drop_last=st.booleans(),
       epochs=st.lists(st.integers(0, 1000), min_size=1, max_size=3))
def test_same_indices_as_torch(n, num_replicas, data, shuffle, seed, drop_last, epochs):
    rank = data.draw(st.integers(0, num_replicas - 1), label="rank")
    dataset = range(n)
    ours = gc.DistributedSampler(dataset, num_replicas, rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    ref = tud.DistributedSampler(dataset, num_replicas, rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    assert len(ours) == len(ref)
    assert list(ours) == list(ref)                               # epoch 0, no set_epoch
    for epoch in epochs:
        ours.set_epoch(epoch)
        ref.set_epoch(epoch)
        assert list(ours) == list(ref), f"epoch {epoch}"


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), num_replicas=st.integers(1, 8), seed=st.integers(0, 1000),
       epoch=st.integers(0, 50))
def test_ranks_partition_the_dataset(n, num_replicas, seed, epoch):
    shards = []
    for rank in range(num_replicas):
        s = gc.DistributedSampler(range(n), num_replicas, rank, seed=seed)
        s.set_epoch(epoch)
        shards.append(list(s))
    assert len({len(s) for s in shards}) == 1                     # every rank: same number of steps
    everything = [i for s in shards for i in s]
    assert set(everything) == set(range(n))                       # nothing forgotten
    assert len(everything) - n < num_replicas                     # at most num_replicas-1 repeats
    # with drop_last: disjoint, and only the tail that does not divide is missing
    dropped = [list(gc.DistributedSampler(range(n), num_replicas, r, seed=seed, drop_last=True))
               for r in range(num_replicas)]
    flat = [i for s in dropped for i in s]
    assert len(flat) == len(set(flat)) == n - n % num_replicas


def test_set_epoch_changes_order_and_forgetting_it_warns():
    s = gc.DistributedSampler(range(100), 2, 0, seed=3)
    first = list(s)
    with pytest.warns(UserWarning, match=r"set_epoch\(epoch\)"):
        again = list(s)
    assert again == first
    s.set_epoch(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(s) != first
    no_shuffle = gc.DistributedSampler(range(10), 2, 0, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(no_shuffle) == list(no_shuffle) == [0, 2, 4, 6, 8]


def test_works_with_a_dataloader():
    ds = torch.utils.data.TensorDataset(torch.arange(10.0))
    sampler = gc.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=2, sampler=sampler)
    assert [b[0].tolist() for b in loader] == [[1.0, 3.0], [5.0, 7.0], [9.0]]


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(num_replicas=2, rank=2), ValueError, r"Invalid rank 2, rank should be in the interval \[0, 1\]"),
    (dict(num_replicas=2, rank=-1), ValueError, r"Invalid rank -1"),
    (dict(num_replicas=0, rank=0), ValueError, r"num_replicas must be >= 1, got 0"),
    (dict(num_replicas=2.0, rank=0), TypeError, r"num_replicas must be an int"),
    (dict(num_replicas=2, rank="0"), TypeError, r"rank must be an int"),
])
def test_bad_arguments(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        gc.DistributedSampler(range(10), **kwargs)


def test_needs_a_process_group_or_explicit_arguments():
    with pytest.raises(RuntimeError, match="init_process_group"):
        gc.DistributedSampler(range(10))
    with pytest.raises(TypeError, match="length"):
        gc.DistributedSampler(iter(range(3)), 1, 0)


def _sampler_from_group(rank, world_size):
    s = gc.DistributedSampler(range(11), seed=5)
    ref = tud.DistributedSampler(range(11), seed=5)
    return s.num_replicas, s.rank, list(s) == list(ref)


def test_reads_rank_and_world_size_from_the_process_group():
    assert gc.launch(_sampler_from_group, 3, timeout=60) == [(3, r, True) for r in range(3)]
