"""The pipeline across processes trains exactly like one process (gloo, 2-4 ranks)."""

import functools
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gpucourse as gc


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 5))


def _data(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 6, generator=g), torch.randint(0, 5, (batch,), generator=g)


def _assert_same_params(got, ref, **tol):
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], msg=lambda m, k=k: f"{k}: {m}", **tol)


@pytest.mark.parametrize("schedule, stages, chunks, batch", [
    ("gpipe", 2, 4, 13), ("1f1b", 2, 5, 11), ("1f1b", 3, 4, 9), ("gpipe", 4, 3, 7)])
def test_pipeline_steps_equal_single_process_training(schedule, stages, chunks, batch):
    x, y = _data(batch)
    run = gc.run_pipeline(make_model, x, y, num_stages=stages, schedule=schedule, chunks=chunks,
                          steps=3, lr=0.5, timeout=60)
    ref = gc.train_sequential(make_model, x, y, steps=3, lr=0.5)
    _assert_same_params(run.state_dict, ref["state_dict"], atol=1e-5, rtol=1e-5)
    assert run.losses == pytest.approx(ref["losses"], rel=1e-5)
    sched = gc.make_schedule(schedule, stages, chunks)
    assert run.peak_in_flight == sched.peak_in_flight()
    # every operation was recorded once, and the measured times respect the dependencies
    events = {(e.stage, e.kind, e.microbatch): e for e in run.timeline.events}
    assert len(events) == 2 * stages * chunks
    for (s, kind, i), e in events.items():
        if kind == "F" and s > 0:
            assert e.start >= events[(s - 1, "F", i)].end
        if kind == "B" and s < stages - 1:
            assert e.start >= events[(s + 1, "B", i)].end
        if kind == "B":
            assert e.start >= events[(s, "F", i)].end


def test_one_f_one_b_holds_fewer_activations_than_gpipe():
    x, y = _data(64)
    gpipe = gc.run_pipeline(make_model, x, y, num_stages=2, schedule="gpipe", chunks=8)
    ofob = gc.run_pipeline(make_model, x, y, num_stages=2, schedule="1f1b", chunks=8)
    assert gpipe.peak_in_flight == [8, 8] and ofob.peak_in_flight == [2, 1]
    # measured bytes that autograd kept alive: roughly proportional to micro-batches in flight
    assert ofob.peak_activation_bytes[0] < 0.5 * gpipe.peak_activation_bytes[0]
    assert ofob.peak_activation_bytes[1] < 0.3 * gpipe.peak_activation_bytes[1]


def test_without_activation_meter_same_training_and_no_bytes():
    x, y = _data(12)
    run = gc.run_pipeline(make_model, x, y, num_stages=2, schedule="1f1b", chunks=4, steps=2, lr=0.5,
                          measure_activations=False)
    ref = gc.train_sequential(make_model, x, y, steps=2, lr=0.5)
    _assert_same_params(run.state_dict, ref["state_dict"], atol=1e-5, rtol=1e-5)
    assert run.peak_activation_bytes == [None, None] and run.peak_in_flight == [2, 1]


def test_data_parallel_times_pipeline_parallel_grid():
    x, y = _data(18)
    run = gc.run_pipeline(make_model, x, y, num_stages=2, dp_size=2, schedule="1f1b", chunks=3,
                          steps=2, lr=0.5, timeout=60)
    ref = gc.train_sequential(make_model, x, y, steps=2, lr=0.5)
    _assert_same_params(run.state_dict, ref["state_dict"], atol=1e-5, rtol=1e-5)
    assert run.losses == pytest.approx(ref["losses"], rel=1e-5)


@pytest.mark.parametrize("frontend", ["manual", "trace"])
def test_torch_pipelining_matches_ours(frontend):
    x, y = _data(12)
    fn = functools.partial(gc.train_torch_pipelining, model_fn=make_model, inputs=x, targets=y,
                           schedule="1f1b", chunks=4, steps=2, lr=0.5, frontend=frontend)
    out = gc.launch(fn, 2, timeout=60)
    ours = gc.run_pipeline(make_model, x, y, num_stages=2, schedule="1f1b", chunks=4, steps=2, lr=0.5)
    state = {**out[0]["state_dict"], **out[1]["state_dict"]}
    _assert_same_params(state, ours.state_dict, atol=1e-5, rtol=1e-5)


def _comm_worker(rank, world_size):
    trace = []
    comm = gc.PipelineComm(trace=trace)
    if comm.is_first:
        comm.send_forward(torch.full((2, 3), 7.0), microbatch=1)
        comm.send_forward(torch.full((1, 3), 5.0), microbatch=0)
        grad = comm.recv_backward(0, shape=(1, 3))
        comm.wait()
        with pytest.raises(RuntimeError, match="no previous stage"):
            comm.send_backward(grad, 0)
        return trace, grad.sum().item()
    comm.post_recv_forward(0, (1, 3))
    a0 = comm.recv_forward(0)                          # tags: micro-batch 0 even though sent second
    a1 = comm.recv_forward(1, shape=(2, 3))
    with pytest.raises(RuntimeError, match="no receive posted"):
        comm.recv_forward(2)
    comm.send_backward(a0 * 2, 0)
    comm.wait()
    return trace, (a0.sum().item(), a1.sum().item())


def test_pipeline_comm_tags_and_trace():
    (trace0, g), (trace1, (a0, a1)) = gc.launch(_comm_worker, 2, timeout=30)
    assert (a0, a1, g) == (15.0, 42.0, 30.0)
    assert trace0[0] == "stage 0: send activation mb 1 (2, 3) -> stage 1"
    assert trace1[0] == "stage 1: recv activation mb 0 (1, 3) <- stage 0"


def test_pipeline_comm_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="needs a process group"):
        gc.PipelineComm()


def _mismatched(rank, world_size):
    sched = gc.gpipe_schedule(2, 2) if rank == 0 else gc.gpipe_schedule(2, 3)
    stage = gc.split_sequential(make_model(), 2)[rank]
    x, y = _data(6)
    gc.pipeline_step(stage, sched, gc.PipelineComm(), batch_size=6, in_shape=(16,), out_shape=(16,),
                     inputs=x if rank == 0 else None, targets=y if rank == 1 else None)


def test_stages_with_different_schedules_fail_instead_of_hanging():
    start = time.perf_counter()
    with pytest.raises(gc.WorkerError, match=r"different pipelines: micro-batches (2 here, 3 there|3 here, 2 there)\. Call"):
        gc.launch(_mismatched, 2, timeout=30)
    assert time.perf_counter() - start < 25       # a clear error, not the launch timeout


def _gpipe_vs_1f1b(rank, world_size):
    sched = gc.make_schedule("gpipe" if rank == 0 else "1f1b", 2, 3)
    stage = gc.split_sequential(make_model(), 2)[rank]
    x, y = _data(6)
    gc.pipeline_step(stage, sched, gc.PipelineComm(), batch_size=6, in_shape=(16,), out_shape=(16,),
                     inputs=x if rank == 0 else None, targets=y if rank == 1 else None)


def test_stages_with_different_schedule_names_fail_clearly():
    name0, name1 = gc.make_schedule("gpipe", 2, 3).name, gc.make_schedule("1f1b", 2, 3).name
    with pytest.raises(gc.WorkerError, match=f"schedule ('{name0}' here, '{name1}'|'{name1}' here, '{name0}') there"):
        gc.launch(_gpipe_vs_1f1b, 2, timeout=30)


def _mismatched_batch(rank, world_size):
    stage = gc.split_sequential(make_model(), 2)[rank]
    x, y = _data(6 + rank)
    gc.pipeline_step(stage, gc.gpipe_schedule(2, 2), gc.PipelineComm(), batch_size=6 + rank,
                     in_shape=(16 + rank,), out_shape=(16,), inputs=x if rank == 0 else None,
                     targets=y if rank == 1 else None)


def test_stages_with_different_batch_or_shape_fail_clearly():
    with pytest.raises(gc.WorkerError, match=r"batch_size (6 here, 7|7 here, 6) there.*boundary shape "
                                             r"(\[16\] here, \[17\]|\[17\] here, \[16\]) there"):
        gc.launch(_mismatched_batch, 2, timeout=30)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_stages=8), ValueError, r"num_stages=8: cannot cut 7 layers into 8 stages"),
    (dict(num_stages=0), ValueError, r"num_stages must be >= 1, got 0"),
    (dict(chunks=0), ValueError, r"chunks must be >= 1 .*got 0"),
    (dict(chunks=2.0), TypeError, r"chunks must be an int, got float 2.0"),
    (dict(chunks=9), ValueError, r"a batch of 8 samples cannot be cut into chunks=9 micro-batches"),
    (dict(chunks=3, dp_size=3), ValueError, r"3 pipelines get 2 or more each.*chunks=3"),
    (dict(schedule="zigzag"), ValueError, r"schedule must be one of \['1f1b', 'gpipe'\].*'zigzag'"),
    (dict(schedule=gc.gpipe_schedule(2, 3)), ValueError, r"for 2 stages and 3 micro-batches, not 2 and 4"),
    (dict(steps=0), ValueError, r"steps must be >= 1, got 0"),
    (dict(balance=[3, 3]), ValueError, r"balance=\[3, 3\]: balance \[3, 3\] covers 6 layers, but the model has 7"),
    (dict(balance=[2, 2, 3]), ValueError, r"balance \[2, 2, 3\] has 3 stages, but num_stages is 2"),
    (dict(model_fn=lambda: nn.Linear(6, 5)), TypeError, r"nn.Sequential.*got Linear"),
    (dict(model_fn="make_model"), TypeError, r"model_fn must be a function"),
    (dict(targets=torch.zeros(7, dtype=torch.long)), ValueError, r"inputs has 8 samples but targets has 7"),
])
def test_run_pipeline_rejects_bad_arguments_before_starting_processes(kwargs, error, match, monkeypatch):
    def no_launch(*args, **kw):
        raise AssertionError("processes were started")
    monkeypatch.setattr("gpucourse.runtime.launch", no_launch)
    x, y = _data(8)
    args = {**dict(model_fn=make_model, inputs=x, targets=y, num_stages=2, chunks=4), **kwargs}
    with pytest.raises(error, match=match):
        gc.run_pipeline(**args)


def test_train_pipeline_checks_its_arguments_in_each_rank():
    x, y = _data(3)
    fn = functools.partial(gc.train_pipeline, model_fn=make_model, inputs=x, targets=y, chunks=4)
    with pytest.raises(gc.WorkerError, match=r"a batch of 3 samples cannot be cut into chunks=4"):
        gc.launch(fn, 2, timeout=30)


@pytest.mark.parametrize("batch, chunks, error, match", [
    (10, 0, ValueError, r"chunks must be >= 1 .*got 0"),
    (10, -1, ValueError, r"chunks must be >= 1 .*got -1"),
    (3, 4, ValueError, r"a batch of 3 samples cannot be cut into 4"),
    (10, 2.5, TypeError, r"chunks must be an int"),
    (10.0, 2, TypeError, r"batch_size must be an int"),
])
def test_microbatch_sizes_rejects_bad_arguments(batch, chunks, error, match):
    with pytest.raises(error, match=match):
        gc.pipeline.pipeline_parallel.microbatch_sizes(batch, chunks)


def test_torch_pipelining_with_uneven_micro_batches_fails_loudly():
    x, y = _data(10)     # 10 samples in 4 micro-batches: ours works, PyTorch 2.14's raises
    fn = functools.partial(gc.train_torch_pipelining, model_fn=make_model, inputs=x, targets=y,
                           chunks=4)
    with pytest.raises(gc.WorkerError):
        gc.launch(fn, 2, timeout=60)


@pytest.mark.multigpu
def test_pipeline_over_nccl_equals_single_process():
    x, y = _data(16)
    run = gc.run_pipeline(make_model, x, y, num_stages=2, schedule="1f1b", chunks=4, steps=2,
                          lr=0.5, backend="nccl", timeout=120)
    ref = gc.train_sequential(make_model, x, y, steps=2, lr=0.5)
    _assert_same_params(run.state_dict, ref["state_dict"], atol=1e-4, rtol=1e-4)
