"""Activation checkpointing: same gradients, fewer bytes kept for backward (measured)."""

import pytest
import torch

import gpucourse as gc


@pytest.mark.parametrize("chosen", [[], [0], [1, 3], [0, 1, 2, 3]])
def test_same_outputs_and_gradients(chosen):
    blocks = gc.residual_mlp(12, 4, seed=1)
    x = torch.randn(5, 12, requires_grad=True)
    blocks(x).square().mean().backward()
    ref = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    blocks.zero_grad()
    x.grad = None
    gc.CheckpointedSequential(blocks, chosen)(x).square().mean().backward()
    got = [p.grad for p in blocks.parameters()] + [x.grad]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_activation_bytes_fall_with_every_checkpointed_block():
    blocks = gc.residual_mlp(32, 6)
    x = torch.randn(16, 32)
    sizes = [gc.activation_bytes(gc.CheckpointedSequential(blocks, range(k)), x) for k in range(7)]
    assert all(a > b for a, b in zip(sizes, sizes[1:]))
    # a block keeps d + 4d + 4d values per row; checkpointed only its input d (~1/9)
    row = 16 * 32 * 4
    assert sizes[0] >= 6 * 9 * row
    assert sizes[6] <= 6 * row + 2 * row


def test_sweep_rows():
    blocks = gc.residual_mlp(16, 4)
    rows = gc.recompute_sweep(blocks, torch.randn(8, 16), [[], [0, 2], [0, 1, 2, 3]], repeats=2)
    assert [r.checkpointed for r in rows] == [[], [0, 2], [0, 1, 2, 3]]
    assert rows[0].activation_bytes > rows[1].activation_bytes > rows[2].activation_bytes
    assert all(r.step_time > 0 for r in rows)


def test_bad_input():
    blocks = gc.residual_mlp(4, 2)
    with pytest.raises(ValueError, match="<= 1"):
        gc.CheckpointedSequential(blocks, [2])
    with pytest.raises(TypeError, match="nn.Sequential"):
        gc.CheckpointedSequential(torch.nn.Linear(2, 2), [0])
    with pytest.raises(ValueError):
        gc.residual_mlp(0, 2)
