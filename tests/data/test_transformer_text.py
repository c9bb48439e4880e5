"""TinyGPT (plain PyTorch) and TinyText (the offline text it learns)."""

import math

import pytest
import torch
import torch.nn.functional as F

import gpucourse as gc


def test_tiny_text_is_deterministic_and_batches_are_shifted_windows():
    a, b = gc.TinyText(3000, seed=1), gc.TinyText(3000, seed=1)
    assert a.text == b.text and len(a.text) == 3000 and a.text != gc.TinyText(3000, seed=2).text
    assert a.decode(a.tokens) == a.text
    x, y = a.batch(6, 20, step=4)
    x2, _ = b.batch(6, 20, step=4)
    assert torch.equal(x, x2) and not torch.equal(x, a.batch(6, 20, step=5)[0])
    for row_x, row_y in zip(x, y):           # each row is a window of the text and its successor
        s = a.decode(row_x)
        start = a.text.find(s + a.decode(row_y[-1:]))
        assert start >= 0 and a.decode(row_y) == a.text[start + 1:start + 21]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        a.encode("GPU")
    with pytest.raises(ValueError, match="seq_len must be <="):
        a.batch(2, 3000)


def test_tinygpt_shapes_tied_head_and_loss():
    torch.manual_seed(0)
    m = gc.TinyGPT(vocab_size=13, seq_len=7, num_layers=3, hidden=12, num_heads=3, ffn_hidden=20)
    idx = torch.randint(0, 13, (4, 7))
    logits = m(idx)
    assert logits.shape == (4, 7, 13)
    torch.testing.assert_close(logits, m.hidden_states(idx) @ m.tok_emb.weight.T)       # tied
    assert not any("head" in n for n, _ in m.named_parameters())
    assert len(m.blocks) == 3 and m.blocks[0].mlp.fc1.out_features == 20
    y = torch.randint(0, 13, (4, 7))
    torch.testing.assert_close(m.loss(idx, y), F.cross_entropy(logits.reshape(-1, 13), y.reshape(-1)))
    # causal: changing the last token does not change earlier positions' logits
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % 13
    torch.testing.assert_close(m(idx2)[:, :-1], logits[:, :-1])
    assert m.config["ffn_hidden"] == 20 and gc.TinyGPT(hidden=8, num_heads=2).config["ffn_hidden"] == 32


def test_tinygpt_checks_its_arguments():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        gc.TinyGPT(hidden=10, num_heads=3)
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        gc.TinyGPT(num_layers=0)
    m = gc.TinyGPT(vocab_size=5, seq_len=4, num_layers=1, hidden=8, num_heads=2)
    with pytest.raises(ValueError, match="seq_len <= 4"):
        m(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="dtype"):
        m(torch.zeros(1, 3))


def test_tinygpt_learns_the_text():
    data = gc.TinyText()
    cfg = dict(vocab_size=data.vocab_size, seq_len=16, num_layers=1, hidden=32, num_heads=2)
    losses = gc.train_tinygpt(cfg, steps=60, batch_size=16)
    assert losses[0] == pytest.approx(math.log(data.vocab_size), rel=0.05)
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0]


def test_generate_appends_the_models_own_predictions():
    torch.manual_seed(0)
    m = gc.TinyGPT(vocab_size=9, seq_len=4, num_layers=1, hidden=8, num_heads=2)
    idx = torch.randint(0, 9, (2, 3))
    out = m.generate(idx, 5)
    assert out.shape == (2, 8) and torch.equal(out[:, :3], idx)
    for t in range(3, 8):                       # greedy: each token is the argmax given the window
        window = out[:, max(0, t - 4):t]
        assert torch.equal(out[:, t], m(window)[:, -1].argmax(-1))
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(m.generate(idx, 4, greedy=False, generator=g1), m.generate(idx, 4, greedy=False, generator=g2))
