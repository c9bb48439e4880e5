"""What a model *is* to the planner: its shape, its parameter count, its FLOPs per token.

A decoder-only transformer of ``L`` layers, width ``h``, ``a`` query heads of size ``d = h/a``,
``a_kv`` key/value heads (grouped-query attention when ``a_kv < a``), an MLP of inner width ``f``
(``E`` experts of which each token uses ``k`` in a mixture of experts), a vocabulary of ``V``::

    per layer   attention   h·h (q) + 2·h·(a_kv·d) (k, v) + h·h (proj)
                MLP         2·h·f (fc1, fc2)   or 3·h·f gated (SwiGLU: w1, w3, w2)     × E experts
                router      h·E (only when E > 1)
                norms       2 per layer (LayerNorm: weight + bias; RMSNorm: weight)
    outside     embedding V·h, learned positions seq·h (not with RoPE), final norm, head V·h (unless tied)

Training FLOPs per token (forward + backward, the backward costing twice the forward)::

    6 · N_matmul  +  12 · L · h · seq
    │                └ attention scores: QKᵀ and A·V, 2·seq·h each per layer forward, ×3 with backward
    └ every weight in a matrix multiply that this token passes through (top-k experts only, head included,
      the embedding lookup excluded: it is a gather, not a multiply)

This is the count of Narayanan et al. 2021 (eq. 3 without recomputation) and of PaLM's appendix B;
it counts the full seq×seq score matrix even for causal attention, as ``FlopCounterMode`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..runtime import check_choice, check_int, check_positive, check_type

__all__ = ["ModelSpec", "training_flops_per_token"]


def training_flops_per_token(matmul_params: int, layers: int, hidden: int, seq: int) -> int:
    """``6 · N_matmul + 12 · L · h · seq``: FLOPs of forward + backward for one token.

    Example::

        >>> training_flops_per_token(matmul_params=1000, layers=2, hidden=8, seq=16)   # 6000 + 3072
        9072
    """
    for name, v in (("matmul_params", matmul_params), ("layers", layers), ("hidden", hidden), ("seq", seq)):
        check_int(name, v, 0)
    return 6 * matmul_params + 12 * layers * hidden * seq


#: Published shapes. Sources: Llama 3 — "The Llama 3 Herd of Models" (Dubey et al. 2024, arXiv:2407.21783),
#: Table 3 (layers, width, FFN width, heads, KV heads, vocabulary 128 000 + 256 reserved = 128 256);
#: GPT-3 175B — Brown et al. 2020, arXiv:2005.14165, Table 2.1 (96 layers, d_model 12 288, 96 heads,
#: context 2048; the GPT-2 vocabulary of 50 257 tokens, learned positions, biases, tied head);
#: Mixtral 8x7B — Jiang et al. 2024, arXiv:2401.04088, Table 1 (32 layers, dim 4096, hidden 14 336,
#: 32 heads, 8 KV heads, vocabulary 32 000, 8 experts, top-2; 46.7 B parameters, 12.9 B active).
_PRESETS = {
    "llama3-8b": dict(layers=32, hidden=4096, heads=32, ffn=14336, vocab=128256, kv_heads=8,
                      gated_mlp=True, bias=False, learned_positions=False),
    "llama3-70b": dict(layers=80, hidden=8192, heads=64, ffn=28672, vocab=128256, kv_heads=8,
                       gated_mlp=True, bias=False, learned_positions=False),
    "llama3-405b": dict(layers=126, hidden=16384, heads=128, ffn=53248, vocab=128256, kv_heads=8,
                        gated_mlp=True, bias=False, learned_positions=False),
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, ffn=4 * 12288, vocab=50257, tied_embeddings=True),
    "mixtral-8x7b": dict(layers=32, hidden=4096, heads=32, ffn=14336, vocab=32000, kv_heads=8, experts=8,
                         top_k=2, gated_mlp=True, bias=False, learned_positions=False),
}
_DEFAULT_SEQ = {"llama3-8b": 8192, "llama3-70b": 8192, "llama3-405b": 8192, "gpt3-175b": 2048,
                "mixtral-8x7b": 4096}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, described by its shape.

    Args:
        layers, hidden, heads, ffn, vocab: ``L``, ``h``, query heads ``a``, MLP width ``f``, ``V``.
        seq: training sequence length (tokens per sequence).
        kv_heads: key/value heads (default ``heads``: plain multi-head attention).
        experts, top_k: a mixture of experts with ``experts`` MLPs per layer, ``top_k`` per token.
        capacity_factor: an expert takes at most ``capacity_factor × the mean`` token copies (the
            rest are dropped, ``gc.MoE(capacity_factor=…)``); ``None``: no limit, and the planner
            assumes a balanced router.
        tied_embeddings: the head reuses the embedding matrix (GPT-2/3, ``gc.TinyGPT``).
        gated_mlp: SwiGLU MLP with three matrices (Llama, Mixtral) instead of two.
        bias: linear layers and norms have biases (GPT) or not (Llama: RMSNorm, no biases).
        learned_positions: a ``max_seq × h`` position embedding (GPT) instead of RoPE (Llama).
        max_seq: rows of the position table (default ``seq``).
        name: a label.

    Example::

        >>> m = ModelSpec.preset("llama3-8b")
        >>> round(m.num_params() / 1e9, 2), m.seq
        (8.03, 8192)
        >>> round(m.flops_per_token() / 1e9, 1)             # GFLOP per token, forward + backward
        57.9

    .. warning::
        ``flops_per_token`` counts matrix multiplies only (norms, softmax and activations are a
        few percent), and the full score matrix even when attention is causal: a fused causal
        kernel does about half of the attention term's work.
    """

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    experts: int = 1
    top_k: int = 1
    tied_embeddings: bool = False
    gated_mlp: bool = False
    bias: bool = True
    learned_positions: bool = True
    max_seq: int | None = None
    capacity_factor: float | None = None
    name: str = "model"

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "ffn", "vocab", "seq", "experts", "top_k"):
            check_int(f, getattr(self, f), 1)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.max_seq is None:
            object.__setattr__(self, "max_seq", self.seq)
        check_int("max_seq", self.max_seq, self.seq, hint=" (at least seq)")
        check_int("kv_heads", self.kv_heads, 1, maximum=self.heads, hint=" (at most heads)")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        check_int("top_k", self.top_k, 1, maximum=self.experts, hint=" (at most experts)")
        for f in ("tied_embeddings", "gated_mlp", "bias", "learned_positions"):
            check_type(f, getattr(self, f), bool)
        if self.capacity_factor is not None:
            check_positive("capacity_factor", self.capacity_factor)

    def expert_load(self, ep: int) -> float:
        """The busiest expert-parallel rank's expert work over the mean: ``min(capacity_factor, ep)``.

        A router is never perfectly balanced (an untrained one least of all), and the step waits for
        the rank whose experts got the most tokens. The capacity bounds it: each expert takes at
        most ``capacity_factor ×`` its mean share, and no rank can get more than all ``ep`` ranks'
        tokens. Without a capacity (``None``) or expert parallelism (``ep == 1``, every rank holds
        every expert): 1.0, the balanced case.

        Example::

            >>> m = ModelSpec(layers=2, hidden=64, heads=4, ffn=256, vocab=64, seq=32, experts=8, top_k=2,
            ...               capacity_factor=1.25)
            >>> m.expert_load(1), m.expert_load(4), replace(m, capacity_factor=None).expert_load(4)
            (1.0, 1.25, 1.0)
        """
        check_int("ep", ep, 1)
        if ep == 1 or self.experts == 1 or self.capacity_factor is None:
            return 1.0
        return float(min(self.capacity_factor, ep))

    def expert_flops_per_token(self) -> int:
        """Forward + backward FLOPs per token in its ``top_k`` expert MLPs (part of ``flops_per_token``).

        Example::

            >>> ModelSpec(layers=2, hidden=64, heads=4, ffn=256, vocab=64, seq=32).expert_flops_per_token()
            393216
        """
        return 6 * self.layers * self.top_k * (3 if self.gated_mlp else 2) * self.hidden * self.ffn

    # --- shapes ------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): ``kv_heads · head_dim``."""
        return self.kv_heads * self.head_dim

    # --- parameters, by where they go when the model is split (see planning.memory) -------------
    def layer_param_groups(self) -> dict[str, int]:
        """Parameters of one layer, by how tensor parallelism treats them.

        ``dense_split``: matrices and column-parallel biases (divided by ``tp``); ``dense_replicated``:
        norms, row-parallel biases, the router (copied on every TP rank); ``expert_split`` /
        ``expert_replicated``: the same for *one* expert's MLP.
        """
        h, kv, f, b = self.hidden, self.kv_dim, self.ffn, int(self.bias)
        norm = h * (2 if self.bias else 1)
        attn_split = 2 * h * h + 2 * h * kv + b * (h + 2 * kv)      # q, k, v, proj; q/k/v biases
        mats = 3 if self.gated_mlp else 2
        expert_split = mats * h * f + b * f * (mats - 1)             # fc1 (and w3) biases split
        expert_rep = b * h                                           # fc2 bias
        router = h * self.experts if self.experts > 1 else 0
        return {"dense_split": attn_split, "dense_replicated": 2 * norm + b * h + router,
                "expert_split": expert_split, "expert_replicated": expert_rep}

    def outside_param_groups(self) -> dict[str, int]:
        """Parameters outside the layers: ``embedding`` (V·h), ``positions``, ``final_norm``, ``head``."""
        h = self.hidden
        return {"embedding": self.vocab * h, "positions": self.max_seq * h if self.learned_positions else 0,
                "final_norm": h * (2 if self.bias else 1),
                "head": 0 if self.tied_embeddings else self.vocab * h}

    def num_params(self) -> int:
        """Every parameter of the model (all experts)."""
        g = self.layer_param_groups()
        per_layer = g["dense_split"] + g["dense_replicated"] + self.experts * (g["expert_split"] + g["expert_replicated"])
        return self.layers * per_layer + sum(self.outside_param_groups().values())

    def num_active_params(self) -> int:
        """Parameters one token uses: ``top_k`` of the experts."""
        g = self.layer_param_groups()
        unused = (self.experts - self.top_k) * (g["expert_split"] + g["expert_replicated"])
        return self.num_params() - self.layers * unused

    def matmul_params(self) -> int:
        """Weights one token multiplies by: attention, ``top_k`` expert MLPs, router, head."""
        h, kv, f = self.hidden, self.kv_dim, self.ffn
        mlp = (3 if self.gated_mlp else 2) * h * f
        router = h * self.experts if self.experts > 1 else 0
        return self.layers * (2 * h * h + 2 * h * kv + self.top_k * mlp + router) + self.vocab * h

    def flops_per_token(self) -> int:
        """Forward + backward FLOPs per token: :func:`training_flops_per_token`."""
        return training_flops_per_token(self.matmul_params(), self.layers, self.hidden, self.seq)

    # --- constructors ----------------------------------------------------------------------------
    @classmethod
    def from_module(cls, module, seq: int | None = None) -> ModelSpec:
        """The spec of a ``gc.TinyGPT`` (exact: same parameter count, same FLOPs as counted).

        Example::

            >>> import gpucourse as gc
            >>> net = gc.TinyGPT(vocab_size=40, seq_len=16, num_layers=2, hidden=32, num_heads=4)
            >>> ModelSpec.from_module(net).num_params() == net.num_parameters()
            True
        """
        config = getattr(module, "config", None)
        if not isinstance(config, dict) or not {"vocab_size", "num_layers", "hidden", "num_heads"} <= set(config):
            raise TypeError(f"module must be a gc.TinyGPT (a module with a TinyGPT config), got "
                            f"{type(module).__name__}")
        seq = config["seq_len"] if seq is None else check_int("seq", seq, 1, maximum=config["seq_len"],
                                                             hint=" (the model's seq_len)")
        return cls(layers=config["num_layers"], hidden=config["hidden"], heads=config["num_heads"],
                   ffn=config["ffn_hidden"], vocab=config["vocab_size"], seq=seq, tied_embeddings=True,
                   max_seq=config["seq_len"], name=type(module).__name__)

    def with_seq(self, seq: int) -> ModelSpec:
        """The same model trained on ``seq``-token sequences (a learned position table grows if needed)."""
        check_int("seq", seq, 1)
        return replace(self, seq=seq, max_seq=max(seq, self.max_seq))

    @classmethod
    def preset(cls, name: str, *, seq: int | None = None) -> ModelSpec:
        """A published model: ``"llama3-8b"``, ``"llama3-70b"``, ``"llama3-405b"``, ``"gpt3-175b"``,
        ``"mixtral-8x7b"`` (sources in this module's ``_PRESETS`` comment).

        Example::

            >>> [round(ModelSpec.preset(n).num_params() / 1e9, 1) for n in ("llama3-70b", "llama3-405b")]
            [70.6, 405.9]
            >>> m = ModelSpec.preset("mixtral-8x7b")
            >>> round(m.num_params() / 1e9, 1), round(m.num_active_params() / 1e9, 1)
            (46.7, 12.9)
        """
        check_choice("name", name, tuple(_PRESETS))
        seq = _DEFAULT_SEQ[name] if seq is None else check_int("seq", seq, 1)
        return cls(seq=seq, name=name, **_PRESETS[name])

    @staticmethod
    def preset_names() -> tuple[str, ...]:
        return tuple(_PRESETS)
