"""Split the course's transformer (``gc.TinyGPT``) across a tensor-parallel group, Megatron's way.

* **MLP** ``fc2(gelu(fc1(x)))``: ``fc1`` column-parallel, ``fc2`` row-parallel — the GELU acts
  on each rank's own columns, no communication between them (that is why ``A`` is split by
  columns: GELU of a sum is not the sum of GELUs).
* **Attention**: heads are independent, so each rank keeps whole heads: ``q``, ``k``, ``v``
  column-parallel by heads (rank ``r``'s ``H_r`` heads), attention on its heads alone, ``proj``
  row-parallel. Again one f in front and one g behind.
* **Embedding and head** (tied): the vocabulary is split (rank ``r`` keeps rows ``v_r`` of
  ``tok_emb``). Lookup: each rank fills the tokens it owns, zeros elsewhere, and g sums. Head:
  ``logits[..., v_r] = f(x) @ W[v_r]ᵀ``, straight into :func:`vocab_parallel_cross_entropy`.
* LayerNorms and the position embedding are replicated: their input is the same on every rank.

Per block: 2 all-reduces forward (the two g's) and 2 backward (the two f's) of ``(B, T, C)`` —
:func:`tp_comm_bytes`.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..data import CausalSelfAttention, FeedForward, TinyGPT
from ..runtime import check_type
from .autograd_ops import copy_to_tensor_parallel, reduce_from_tensor_parallel, tensor_split_sizes
from .checks import agree_across_ranks, check_same_shape, group_layout
from .layers import ColumnParallelLinear, RowParallelLinear
from .vocab import vocab_parallel_cross_entropy

__all__ = ["TensorParallelMLP", "TensorParallelAttention", "VocabParallelEmbedding", "TensorParallelGPT",
           "tensor_parallel_mlp", "tensor_parallel_attention", "tensor_parallel_gpt"]


class TensorParallelMLP(nn.Module):
    """``row(act(column(x)))``: one all-reduce forward, one backward (see :func:`tensor_parallel_mlp`)."""

    def __init__(self, fc1: nn.Linear, act: nn.Module, fc2: nn.Linear, group=None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(fc1, group)            # (..., C) -> (..., ffn_r)
        self.act = copy.deepcopy(act)
        self.fc2 = RowParallelLinear(fc2, group)               # (..., ffn_r) -> (..., C), g inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TensorParallelAttention(nn.Module):
    """Causal self-attention with this rank's heads (see :func:`tensor_parallel_attention`)."""

    def __init__(self, attn: CausalSelfAttention, group=None):
        super().__init__()
        heads, d = attn.num_heads, attn.head_dim
        agree_across_ranks(group, "the attention passed to tensor_parallel_attention", {"heads": heads, "head_dim": d})
        _, world, _ = group_layout(group)
        if heads < world:
            raise ValueError(f"tensor_parallel_attention: {heads} heads cannot be split over {world} ranks; "
                             "each rank needs at least one head")
        sizes = [h * d for h in tensor_split_sizes(heads, world)]           # whole heads per rank
        self.group, self.head_dim = group, d
        self.q, self.k, self.v = (ColumnParallelLinear(lin, group, sizes=sizes) for lin in (attn.q, attn.k, attn.v))
        self.proj = RowParallelLinear(attn.proj, group, sizes=sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        check_same_shape(x, self.group, "the input of tensor_parallel_attention")
        x = copy_to_tensor_parallel(x, self.group)                            # f, once for q, k and v
        q, k, v = (F.linear(x, lin.weight, lin.bias).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))                       # (B, H_r, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)         # this rank's heads
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))               # row-parallel: g inside


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of an ``nn.Embedding`` (split by vocabulary as ``tensor_split``); g sums the lookups."""

    def __init__(self, embedding: nn.Embedding, group=None):
        super().__init__()
        check_type("embedding", embedding, nn.Embedding, "a torch.nn.Embedding")
        w = embedding.weight.detach()
        agree_across_ranks(group, "the embedding passed to VocabParallelEmbedding",
                           {"shape": tuple(w.shape), "sum of the weights": round(float(w.double().sum()), 6)})
        rank, world, _ = group_layout(group)
        if embedding.num_embeddings < world:
            raise ValueError(f"VocabParallelEmbedding: {embedding.num_embeddings} rows cannot be split over "
                             f"{world} ranks")
        self.sizes = tensor_split_sizes(embedding.num_embeddings, world)
        self.start, self.group = sum(self.sizes[:rank]), group
        self.weight = nn.Parameter(w[self.start:self.start + self.sizes[rank]].clone())   # (V_r, C)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine.unsqueeze(-1)
        return reduce_from_tensor_parallel(out, self.group, label="embedding")   # each token from its owner


class TensorParallelGPT(nn.Module):
    """A ``TinyGPT`` split over a tensor-parallel group (see :func:`tensor_parallel_gpt`)."""

    def __init__(self, model: TinyGPT, group=None):
        super().__init__()
        self.config, self.group = dict(model.config), group
        self.tok_emb = VocabParallelEmbedding(model.tok_emb, group)        # also the (tied) head
        self.pos_emb = copy.deepcopy(model.pos_emb)                        # replicated
        self.blocks = nn.ModuleList()
        for block in model.blocks:
            split = nn.Module()
            split.ln1, split.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
            split.attn = tensor_parallel_attention(block.attn, group)
            split.mlp = tensor_parallel_mlp(block.mlp, group)
            self.blocks.append(split)
        self.ln_f = copy.deepcopy(model.ln_f)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids → this rank's logits ``(B, T, V_r)``."""
        T = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))   # (B, T, C)
        for b in self.blocks:
            x = self.run_block(b, x)
        x = copy_to_tensor_parallel(self.ln_f(x), self.group, label="head")        # f before the head
        return F.linear(x, self.tok_emb.weight)                                    # (B, T, V_r)

    @staticmethod
    def run_block(b: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One tensor-parallel block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(…))`` (f/g inside).

        The blocks' forward is inlined here rather than in the blocks; a caller wraps this method
        to change how every block runs (``torch.utils.checkpoint`` for full recomputation)."""
        x = x + b.attn(b.ln1(x))
        return x + b.mlp(b.ln2(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The same number as ``TinyGPT.loss``, computed without gathering the logits."""
        return vocab_parallel_cross_entropy(self(idx), targets, self.group)


def tensor_parallel_mlp(mlp: nn.Module, group=None) -> TensorParallelMLP:
    """Split a transformer MLP: first Linear column-parallel, second row-parallel.

    Args:
        mlp: a ``gc.FeedForward`` (``fc1``, ``act``, ``fc2``) or an ``nn.Sequential(Linear, act, Linear)``,
            identical on every rank.
        group: the tensor-parallel group (default: all ranks).

    Example::

        >>> mlp = FeedForward(8, 32)
        >>> x = torch.randn(2, 5, 8)
        >>> torch.allclose(tensor_parallel_mlp(mlp)(x), mlp(x))     # one process: the same MLP
        True

    .. warning::
        The activation must act element by element (GELU, ReLU): it runs on each rank's slice.
        A LayerNorm or softmax *inside* the MLP would need the whole hidden vector.
    """
    if isinstance(mlp, FeedForward):
        fc1, act, fc2 = mlp.fc1, mlp.act, mlp.fc2
    elif isinstance(mlp, nn.Sequential) and len(mlp) == 3 and isinstance(mlp[0], nn.Linear) \
            and isinstance(mlp[2], nn.Linear):
        fc1, act, fc2 = mlp
    else:
        raise TypeError(f"mlp must be a gc.FeedForward or nn.Sequential(Linear, activation, Linear), "
                        f"got {type(mlp).__name__}")
    return TensorParallelMLP(fc1, act, fc2, group)


def tensor_parallel_attention(attn: CausalSelfAttention, group=None) -> TensorParallelAttention:
    """Split a ``gc.CausalSelfAttention`` by heads: rank ``r`` keeps heads ``tensor_split(range(H), world)[r]``.

    Example::

        >>> attn = CausalSelfAttention(hidden=8, num_heads=2)
        >>> x = torch.randn(2, 5, 8)
        >>> torch.allclose(tensor_parallel_attention(attn)(x), attn(x), atol=1e-6)
        True

    .. warning::
        Splitting ``q``'s output features evenly is not enough: with 3 heads on 2 ranks an even
        split of the features would cut a head in half. The split here follows heads.
    """
    check_type("attn", attn, CausalSelfAttention, "a gc.CausalSelfAttention")
    return TensorParallelAttention(attn, group)


def tensor_parallel_gpt(model: TinyGPT, group=None) -> TensorParallelGPT:
    """Split a whole ``gc.TinyGPT``: vocabulary-parallel embedding and tied head, every block split.

    Returns a module whose ``forward(idx)`` gives this rank's logits ``(B, T, V_r)`` and whose
    ``loss(idx, targets)`` equals ``model.loss(idx, targets)``; each parameter's gradient is the
    matching slice of the full model's.

    Example::

        >>> _ = torch.manual_seed(0)
        >>> model = TinyGPT(vocab_size=20, seq_len=8, num_layers=1, hidden=16, num_heads=2)
        >>> idx = torch.randint(0, 20, (2, 8))
        >>> torch.allclose(tensor_parallel_gpt(model).loss(idx, idx), model.loss(idx, idx))
        True

    .. warning::
        Every rank of the group must build it from the same ``TinyGPT`` (same seed) and feed it
        the same batch: tensor parallelism splits the model, not the data.
    """
    check_type("model", model, TinyGPT, "a gc.TinyGPT")
    return TensorParallelGPT(model, group)
