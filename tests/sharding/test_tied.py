"""Tied weights under sharding: TinyGPT's head reads ``tok_emb.weight`` outside the embedding's forward.

ZeRO-3 and FSDP2 free a layer's full parameters when its forward ends; the tied head needs the
embedding's after that. Both must still train TinyGPT exactly as one process does on the whole batch.
"""

import pytest
import torch
import torch.nn.functional as F

import gpucourse as gc

CFG = dict(vocab_size=16, seq_len=8, num_layers=2, hidden=8, num_heads=2)
STEPS, LR = 3, 0.02
ADAM = dict(lr=LR, eps=1e-4)    # attention's key bias gets a zero gradient (softmax ignores it): a larger
                                # eps keeps Adam from blowing its rounding noise up to ±lr


def make_gpt():
    return gc.TinyGPT(**CFG)


def next_token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _data():
    g = torch.Generator().manual_seed(5)
    return (torch.randint(0, CFG["vocab_size"], (8, CFG["seq_len"]), generator=g),
            torch.randint(0, CFG["vocab_size"], (8, CFG["seq_len"]), generator=g))


@pytest.fixture(scope="module")
def single():
    """The oracle: one process, the whole batch, plain AdamW."""
    x, y = _data()
    torch.manual_seed(0)
    model = make_gpt()
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    losses = []
    for _ in range(STEPS):
        loss = next_token_loss(model(x), y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy,accumulation", [("zero3", 2), ("fsdp2", 1)])
def test_tied_tinygpt_trains_like_one_process(single, strategy, accumulation):
    losses, state = single
    x, y = _data()
    run = gc.train_sharded(strategy, make_gpt, x, y, world_size=2, steps=STEPS, accumulation=accumulation,
                           loss_fn=next_token_loss, **ADAM)
    assert run.state_dict.keys() == state.keys()
    for k, v in state.items():          # the tied weight got both gradients (embedding + head)
        torch.testing.assert_close(run.state_dict[k], v, atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    assert run.losses == pytest.approx(losses, rel=1e-5)
    assert run.losses[-1] < run.losses[0]


def test_keep_gathered_is_checked():
    with pytest.raises(ValueError, match="keep_gathered"):
        gc.FullyShardedModule(make_gpt(), keep_gathered=["head"])
    with pytest.raises(TypeError, match="keep_gathered"):
        gc.FullyShardedModule(make_gpt(), keep_gathered="tok_emb")


class TiedMLP(torch.nn.Module):
    """A head tied to a Linear (not an embedding): only ``keep_gathered=["inp"]`` makes it work."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid = torch.nn.Linear(4, 6), torch.nn.Linear(6, 6)

    def forward(self, x):                                   # (B, 4) -> (B, 4)
        return F.linear(self.mid(torch.tanh(self.inp(x))), self.inp.weight.t())


def _tied_mlp_rank(rank, world_size, x, y):
    torch.manual_seed(0)
    model = gc.FullyShardedModule(TiedMLP(), keep_gathered=["inp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        F.mse_loss(model(x.tensor_split(world_size)[rank]), y.tensor_split(world_size)[rank]).backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


def test_keep_gathered_names_a_tied_linear():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    torch.manual_seed(0)
    ref = TiedMLP()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    got = gc.launch(_tied_mlp_rank, 2, args=(x, y), timeout=60)
    for state in got:
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


class TiedModules(torch.nn.Module):
    """nanoGPT's tie, ``head.weight = wte.weight``: one Parameter that two modules hold (unlike
    TinyGPT's functional head). Sharded twice, the tie would silently come apart."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.mid = torch.nn.Embedding(10, 6), torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):                                  # (B, T) -> (B, T, vocab)
        return self.head(torch.tanh(self.mid(self.wte(idx))))


def _tied_modules_rank(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    sharded, ddp = gc.FullyShardedModule(TiedModules()), DDP(TiedModules())
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in (sharded, ddp)]
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 10, (4, 5), generator=g).tensor_split(world_size)[rank]
        for model, opt in zip((sharded, ddp), opts):
            next_token_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
    return sharded.full_state_dict(), ddp.module.state_dict(), len(sharded.shards)


def test_a_weight_two_modules_hold_stays_one_weight():
    for full, ref, units in gc.launch(_tied_modules_rank, 2, timeout=60):
        assert units == 2                                    # wte (with the head's alias) and mid
        assert list(full) == list(ref)                       # both names, as the model's state_dict
        assert all(torch.equal(full[k], v) for k, v in ref.items())     # 2 ranks: DDP's bits
        assert torch.equal(full["head.weight"], full["wte.weight"])


def test_keep_gathered_must_name_a_tied_unit():
    model = TiedModules()
    with pytest.raises(ValueError, match=r"tied weights.*head\.weight.*\['wte'\]"):
        gc.FullyShardedModule(model, keep_gathered=[])
