"""TinyGPT: the course's small GPT, in plain PyTorch — what the model *is*, apart from how it is split.

Chapters 09–12 split this one model in different ways (tensor, pipeline, context, expert
parallelism); the splitting lives in those parts (``tensor_parallel/`` …), never here, as
torchtitan keeps ``model.py`` apart from ``parallelize.py``::

    idx (B, T) token ids
    ├─ tok_emb(idx) + pos_emb(arange(T))                          (B, T, C)
    ├─ num_layers × TransformerBlock:
    │      x = x + attn(ln1(x))      causal self-attention, num_heads heads of C / num_heads
    │      x = x + mlp(ln2(x))       Linear(C, ffn) → GELU → Linear(ffn, C)
    ├─ ln_f(x)                                                    (B, T, C)
    └─ logits = x @ tok_emb.weightᵀ   the head is *tied* to the embedding   (B, T, V)

No dropout (a run is deterministic given the seed), biases everywhere (so the tensor-parallel split
has to handle them). The attention keeps separate ``q``, ``k``, ``v`` projections (Megatron fuses
them into one matrix; separate ones make the split by heads easy to read).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import check_int, check_tensor

__all__ = ["TinyGPT", "TransformerBlock", "CausalSelfAttention", "FeedForward"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``proj(softmax(q kᵀ / √d + mask) v)`` per head.

    Args:
        hidden: model width ``C``.
        num_heads: heads; ``hidden`` must be a multiple of it (head size ``C / num_heads``).

    Example::

        >>> attn = CausalSelfAttention(hidden=8, num_heads=2)
        >>> attn(torch.randn(3, 5, 8)).shape               # (B, T, C) -> (B, T, C)
        torch.Size([3, 5, 8])

    .. warning::
        Causal: position ``t`` sees positions ``<= t`` only; do not feed it padded batches without
        a mask of your own.
    """

    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        check_int("hidden", hidden, 1)
        check_int("num_heads", num_heads, 1)
        if hidden % num_heads:
            raise ValueError(f"hidden ({hidden}) must be a multiple of num_heads ({num_heads})")
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, H·D) -> (B, H, T, D): one attention per head
        q, k, v = (lin(x).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)     # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))         # (B, T, C)


class FeedForward(nn.Module):
    """The transformer's MLP: ``fc2(gelu(fc1(x)))``, ``C → ffn → C``.

    Example::

        >>> FeedForward(8, 32)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        check_int("hidden", hidden, 1)
        check_int("ffn_hidden", ffn_hidden, 1)
        self.fc1, self.act, self.fc2 = nn.Linear(hidden, ffn_hidden), nn.GELU(), nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    Example::

        >>> TransformerBlock(8, 2, 16)(torch.randn(2, 4, 8)).shape
        torch.Size([2, 4, 8])
    """

    def __init__(self, hidden: int, num_heads: int, ffn_hidden: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(hidden), CausalSelfAttention(hidden, num_heads)
        self.ln2, self.mlp = nn.LayerNorm(hidden), FeedForward(hidden, ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small GPT: token + position embedding, ``num_layers`` blocks, final LayerNorm, tied head.

    Args:
        vocab_size: tokens (``TinyText().vocab_size`` for the course's text).
        seq_len: the longest sequence (rows of the position embedding).
        num_layers: transformer blocks.
        hidden: model width ``C``.
        num_heads: attention heads per block (must divide ``hidden``).
        ffn_hidden: the MLP's inner width (default ``4 × hidden``).

    Example::

        >>> _ = torch.manual_seed(0)
        >>> model = TinyGPT(vocab_size=40, seq_len=16, num_layers=2, hidden=32, num_heads=4)
        >>> idx = torch.randint(0, 40, (3, 16))
        >>> model(idx).shape                              # (B, T) -> (B, T, vocab) logits
        torch.Size([3, 16, 40])
        >>> targets = torch.randint(0, 40, (3, 16))
        >>> round(model.loss(idx, targets).item(), 1)     # untrained: about ln(40) = 3.7
        3.7
        >>> model.num_parameters()
        27264

    .. warning::
        The head is tied to the token embedding (``logits = x @ tok_emb.weightᵀ``): there is no
        separate ``head`` parameter, and a split of the embedding must split the head the same
        way (tensor parallelism shards both along the vocabulary).
    """

    def __init__(self, vocab_size: int = 64, seq_len: int = 32, num_layers: int = 2, hidden: int = 64,
                 num_heads: int = 4, ffn_hidden: int | None = None):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("seq_len", seq_len), ("num_layers", num_layers),
                            ("hidden", hidden), ("num_heads", num_heads)):
            check_int(name, value, 1)
        ffn_hidden = 4 * hidden if ffn_hidden is None else check_int("ffn_hidden", ffn_hidden, 1)
        if hidden % num_heads:
            raise ValueError(f"hidden ({hidden}) must be a multiple of num_heads ({num_heads})")
        self.config = dict(vocab_size=vocab_size, seq_len=seq_len, num_layers=num_layers, hidden=hidden,
                           num_heads=num_heads, ffn_hidden=ffn_hidden)
        self.tok_emb = nn.Embedding(vocab_size, hidden)
        self.pos_emb = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(TransformerBlock(hidden, num_heads, ffn_hidden) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:     # GPT-2's: N(0, 0.02), zero biases
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear):
            nn.init.zeros_(m.bias)

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """Everything but the head: ``(B, T)`` ids → ``(B, T, C)`` after ``ln_f``."""
        check_tensor("idx", idx, ndim=2, dtypes=(torch.int64, torch.int32))
        T = idx.shape[1]
        if T > self.config["seq_len"]:
            raise ValueError(f"idx has {T} positions, the model was built for seq_len <= {self.config['seq_len']}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))   # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.linear(self.hidden_states(idx), self.tok_emb.weight)             # (B, T, V), tied

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the next-token prediction over every position."""
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, greedy: bool = True,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` predicted tokens to ``idx`` ``(B, T)``; returns ``(B, T + new)``.

        Each new token comes from the last ``seq_len`` positions: the most likely one (``greedy``)
        or a sample from the softmax (with ``generator`` for reproducible samples).
        """
        check_int("max_new_tokens", max_new_tokens, 0)
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config["seq_len"]:])[:, -1]                  # (B, V)
            if greedy:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                nxt = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
