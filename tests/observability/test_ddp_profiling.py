"""DDP options measured: bytes from the trace follow the dtype the hook sends."""

import torch

import gpucourse as gc


def _options(rank, world_size, folder):
    torch.set_num_threads(1)
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))

    def model_fn():
        torch.manual_seed(1)
        return gc.MLP(16, 64, 3)
    out = []
    for name, kw in [("plain", {}), ("view", {"gradient_as_bucket_view": True}),
                     ("static", {"static_graph": True}), ("bf16", {"comm_hook": "bf16"})]:
        r = gc.measure_ddp_option(name, model_fn, x, y, f"{folder}/{name}{rank}.json", steps=2, **kw)
        out.append((r.name, r.bytes_per_step, r.step_time > 0, 0 <= r.hidden_fraction <= 1))
    return out


def test_bytes_per_option(tmp_path):
    numel = sum(p.numel() for p in gc.MLP(16, 64, 3).parameters())
    results = gc.launch(_options, 2, args=(str(tmp_path),), timeout=120)
    assert results[0] == results[1]
    assert results[0] == [("plain", 4 * numel, True, True), ("view", 4 * numel, True, True),
                          ("static", 4 * numel, True, True), ("bf16", 2 * numel, True, True)]
