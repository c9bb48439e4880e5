"""FullyShardedModule with frozen parameters and a compute dtype equals FSDP2 ``fully_shard`` with
``MixedPrecisionPolicy(param_dtype=…, reduce_dtype=torch.float32)``, bit for bit on 2 gloo ranks."""

import torch
import torch.nn.functional as F
from torch import nn

import gpucourse as gc

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Net(nn.Module):
    """A frozen embedding (kept gathered for the whole forward), and a frozen Linear in the middle:
    the backward still needs its weight for the input gradient, so it is gathered again there."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 12)
        self.body = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 12))
        self.head = nn.Linear(12, 5)
        self.emb.requires_grad_(False)
        self.body[3].requires_grad_(False)

    def forward(self, idx):
        return self.head(self.body(self.emb(idx)).mean(1))


def batch(step, rank, world_size):
    g = torch.Generator().manual_seed(700 + step)
    idx, y = torch.randint(0, 20, (8, 6), generator=g), torch.randn(8, 5, generator=g)
    return idx.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]


def fsdp2(dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = Net()
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in [*model.body, model.head]:                 # one unit per layer, the embedding in the root
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _vs_fsdp2(rank, world_size, steps):
    from gpucourse.sharding import fsdp

    calls = {"reduce-scatter": 0, "all-gather dtypes": set()}
    reduce_scatter, all_gather = fsdp._reduce_scatter_flat, fsdp._all_gather_flat

    def counted_reduce_scatter(buf, group=None):
        calls["reduce-scatter"] += 1
        return reduce_scatter(buf, group)

    def recorded_all_gather(buf, group=None):
        calls["all-gather dtypes"].add(buf.dtype)
        return all_gather(buf, group)

    fsdp._reduce_scatter_flat, fsdp._all_gather_flat = counted_reduce_scatter, recorded_all_gather
    out = {}
    for dtype in DTYPES:
        ref = fsdp2(dtype)
        ours = gc.FullyShardedModule(Net(), param_dtype=None if dtype == torch.float32 else dtype)
        opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.01, weight_decay=0.1)
                for m in (ref, ours)]
        calls["reduce-scatter"], calls["all-gather dtypes"] = 0, set()
        equal, out_dtypes, gather_dtypes = [], set(), set()
        for step in range(steps):
            idx, y = batch(step, rank, world_size)
            outs = []
            for model, opt in zip((ref, ours), opts):
                o = model(idx)
                outs.append(o.detach())
                F.mse_loss(o.float(), y).backward()
                if model is ours:
                    grads = [(p.dtype, p.grad is None or p.grad.dtype, p.requires_grad) for p in ours.parameters()]
                    gathered_left = [u.path for u in ours._units if u.full is not None]
                opt.step()
                opt.zero_grad()
            out_dtypes.add(outs[1].dtype)
            gather_dtypes |= calls["all-gather dtypes"]          # training's, not the check's below
            want = {k: v.full_tensor() for k, v in ref.state_dict().items()}
            got = ours.full_state_dict()
            equal.append(torch.equal(outs[0], outs[1]) and want.keys() == got.keys()
                         and all(torch.equal(got[k], v) for k, v in want.items()))
            calls["all-gather dtypes"] = set()
        frozen_kept = all(torch.equal(got[k], Net().state_dict()[k]) for k in ("emb.weight", "body.3.weight", "body.3.bias"))
        out[str(dtype)] = {"equal": equal, "out_dtypes": out_dtypes, "grads": grads, "gathered_left": gathered_left,
                           "reduce_scatters": calls["reduce-scatter"], "gather_dtypes": gather_dtypes,
                           "frozen_kept": frozen_kept}
    return out


def test_frozen_parameters_and_param_dtype_equal_fsdp2():
    steps = 3
    for rank, result in enumerate(gc.launch(_vs_fsdp2, 2, args=(steps,), timeout=180)):
        for dtype in DTYPES:
            r = result[str(dtype)]
            assert r["equal"] == [True] * steps, f"rank {rank} {dtype}: {r['equal']}"
            assert r["out_dtypes"] == {dtype}                       # the layers computed in dtype
            assert r["gather_dtypes"] == {dtype}                    # ... gathered in it (cast first)
            # fp32 master shards; trainable ones got fp32 gradients, frozen ones none
            assert all(p == torch.float32 and (g is True) != trainable and (g is True or g == torch.float32)
                       for p, g, trainable in r["grads"]), r["grads"]
            assert r["frozen_kept"] and r["gathered_left"] == []
            # frozen units (embedding, body.3) are never reduce-scattered: 3 trainable units per step
            assert r["reduce_scatters"] == 3 * steps
