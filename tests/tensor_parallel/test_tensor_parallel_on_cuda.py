"""Chapter 09's 2-D training on a GPU: NCCL, the model and the batch on ``cuda:<rank>``.

A world of one (one GPU holds one NCCL rank), compared with the same run over gloo on the CPU.
"""

import pytest

import gpucourse as gc

pytestmark = pytest.mark.cuda

GPT = dict(vocab_size=27, seq_len=8, num_layers=1, hidden=16, num_heads=2)


def test_tinygpt_2d_trains_on_cuda_as_on_the_cpu():
    on_gpu = gc.train_tinygpt_2d(GPT, tp=1, dp=1, steps=3, batch_size=4, backend="nccl", timeout=180)
    on_cpu = gc.train_tinygpt_2d(GPT, tp=1, dp=1, steps=3, batch_size=4, backend="gloo", timeout=180)
    assert on_gpu[0]["losses"] == pytest.approx(on_cpu[0]["losses"], rel=1e-4)
    assert on_gpu[0]["losses"] == pytest.approx(gc.train_tinygpt(GPT, steps=3, batch_size=4), rel=1e-4)
