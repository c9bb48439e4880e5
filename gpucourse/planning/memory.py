"""Memory of a training step, term by term: model states (ZeRO) and saved activations (Korthikanti).

Per device, for the busiest pipeline stage::

    model states  = zero_memory_parts(params on this rank, ranks sharing them, zero)     chapter 08
    activations   = in-flight micro-batches × (layers of the stage × one layer's saved bytes + extras)

One layer's saved bytes follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", arXiv:2205.05198, section 4): every tensor the backward needs, listed
(:func:`activation_terms`). For GPT-3-style layers with dropout and an attention that stores its
``seq × seq`` scores it sums to the paper's ``s·b·h·(34 + 5·a·s/h)`` bytes (16-bit), with tensor
parallelism ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``, with sequence parallelism all of it divided by
``t``, with full recomputation ``2·s·b·h`` (:func:`korthikanti_layer_bytes`). A fused
("flash") attention keeps its output and log-sum-exp instead of the scores.
"""

from __future__ import annotations

from ..runtime import check_choice, check_int, check_positive
from ..sharding import zero_memory_parts
from .config import ParallelConfig
from .model_spec import ModelSpec

__all__ = ["activation_terms", "layer_activation_bytes", "korthikanti_layer_bytes", "outside_activation_bytes",
           "inflight_microbatches", "stage_layers", "stage_params", "model_state_bytes", "split_problem"]


def activation_terms(model: ModelSpec, *, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
                     cp: int = 1, recompute: str = "none", dtype_bytes: int = 2, attention: str = "flash",
                     dropout: bool = False, expert_load: float = 1.0) -> list[tuple[str, int]]:
    """Every tensor one layer saves for its backward, on one rank: ``[(name, bytes), …]``.

    Args:
        model: the layer's shape (``hidden``, ``heads``, ``kv_heads``, ``ffn``, experts).
        micro_batch: sequences per micro-batch ``b``; this rank holds ``b · seq/cp`` tokens.
        tp, sequence_parallel: matrices split over ``tp`` ranks; with sequence parallelism the
            tensors outside them (norm inputs, dropout masks) are split along the sequence too.
        cp: context parallelism — ``seq/cp`` tokens of each sequence on this rank.
        recompute: ``"none"``; ``"selective"`` drops the attention core's tensors; ``"full"`` keeps
            only the layer's input.
        dtype_bytes: bytes per activation element (2 for bf16, 4 for fp32); softmax statistics are fp32,
            dropout masks 1 byte.
        attention: ``"flash"`` (a fused kernel: keeps its output and log-sum-exp, no scores) or
            ``"eager"`` (keeps the ``seq × seq`` softmax, as in the paper).
        dropout: the layer has dropout (GPT-3 did; current LLM pre-training and ``gc.TinyGPT`` do not).
        expert_load: the token copies this rank's experts receive over the even share
            (``model.expert_load(ep)`` for the busiest expert-parallel rank): scales what the experts
            keep (their inputs and MLP tensors), not the rank's own routing and combine tensors.

    Example::

        >>> m = ModelSpec(layers=1, hidden=64, heads=4, ffn=256, vocab=64, seq=32)
        >>> terms = dict(activation_terms(m, micro_batch=3, dtype_bytes=4))
        >>> terms["q"], terms["fc2 input (activation output)"]      # 3·32 tokens × 64 or 256 × 4 bytes
        (24576, 98304)
        >>> activation_terms(m, micro_batch=3, recompute="full", dtype_bytes=4)
        [('layer input', 24576)]

    .. warning::
        These are the bytes *saved* when the forward ends. A full-recompute backward rebuilds one
        layer's activations at a time, so the peak holds one layer's worth more.
    """
    check_int("micro_batch", micro_batch, 1)
    check_int("tp", tp, 1)
    check_int("cp", cp, 1)
    check_choice("recompute", recompute, ("none", "selective", "full"))
    check_int("dtype_bytes", dtype_bytes, 1)
    check_choice("attention", attention, ("flash", "eager"))
    check_positive("expert_load", expert_load)
    if model.seq % cp:
        raise ValueError(f"seq ({model.seq}) must be divisible by cp ({cp})")
    tokens = micro_batch * (model.seq // cp)             # b · s/cp tokens on this rank
    rep = tp if sequence_parallel else 1                 # "replicated" tensors: split only with SP
    h, kv, f, a, e = model.hidden, model.kv_dim, model.ffn, model.heads, dtype_bytes

    def t(name, per_token, split, nbytes=e, load=1.0):
        return (name, int(tokens * per_token * nbytes * load) // split)

    if recompute == "full":
        return [t("layer input", h, rep)]
    stats = 2 if model.bias else 1                       # LayerNorm: mean, rstd; RMSNorm: rstd
    terms = [t("norm 1 input", h, rep), t("norm 1 statistics", stats, rep, 4),
             t("q, k, v input (norm 1 output)", h, rep),
             t("q", h, tp), t("k", kv, tp), t("v", kv, tp)]
    if recompute != "selective":                         # the attention core (Korthikanti's "selective")
        if attention == "eager":                         # scores of every query against all seq keys
            terms.append(t("softmax output", a * model.seq, tp))
            if dropout:
                terms += [t("attention dropout mask", a * model.seq, tp, 1),
                          t("attention dropout output", a * model.seq, tp)]
        else:
            terms.append(t("log-sum-exp", a, tp, 4))
    terms.append(t("proj input (attention output)", h, tp))
    if dropout:
        terms.append(t("dropout mask after attention", h, rep, 1))
    terms += [t("norm 2 input", h, rep), t("norm 2 statistics", stats, rep, 4),
              t("MLP input (norm 2 output)", h, rep)]
    k = model.top_k if model.experts > 1 else 1          # each token's copies, one per chosen expert
    if model.experts > 1:                                # the router, the dispatch and the combine (gc.MoE)
        terms += [t("router probabilities", model.experts, rep, 4),
                  t("routing indices (top-k ids, each copy's token and slot)", 3 * k, rep, 8),
                  t("routing weights (top-k, their sum, each copy's)", 2 * k + 1, rep, 4),
                  t("expert inputs (dispatched tokens)", k * h, rep, load=expert_load)]
    x = expert_load if model.experts > 1 else 1.0        # what this rank's experts were sent
    if model.gated_mlp:
        terms += [t("w1 output (SiLU input)", k * f, tp, load=x), t("w3 output", k * f, tp, load=x),
                  t("SiLU output", k * f, tp, load=x), t("w2 input (gate product)", k * f, tp, load=x)]
    else:
        terms += [t("fc1 output (activation input)", k * f, tp, load=x),
                  t("fc2 input (activation output)", k * f, tp, load=x)]
    if model.experts > 1:                                # y = Σ w · expert output: both factors' results kept
        terms += [t("expert outputs (combine input)", k * h, rep), t("weighted expert outputs", k * h, rep)]
    if dropout:
        terms.append(t("dropout mask after MLP", h, rep, 1))
    return terms


def layer_activation_bytes(model: ModelSpec, **kwargs) -> int:
    """Sum of :func:`activation_terms` (same arguments): one layer, one micro-batch, one rank."""
    return sum(b for _, b in activation_terms(model, **kwargs))


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, *, sequence_parallel: bool = False,
                            recompute: str = "none") -> float:
    """The paper's closed forms (Table 2), bytes per layer, 16-bit activations, dropout, eager attention.

    Example::

        >>> korthikanti_layer_bytes(2048, 1, 12288, 96) / 2**20          # GPT-3 175B, one sequence
        2736.0
        >>> korthikanti_layer_bytes(2048, 1, 12288, 96, 8, sequence_parallel=True, recompute="selective") / 2**20
        102.0
    """
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    scores = 0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return s * b * h / t * (34 + scores)
    return s * b * h * (10 + 24 / t + scores / t)


def outside_activation_bytes(model: ModelSpec, *, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
                             cp: int = 1, dtype_bytes: int = 2, first: bool = True, last: bool = True) -> int:
    """Saved bytes outside the layers: token (and position) ids on the first stage; the final norm's
    input, statistics and output and the fp32 log-softmax over this rank's ``V/tp`` vocabulary on the last.

    Example::

        >>> m = ModelSpec(layers=1, hidden=64, heads=4, ffn=256, vocab=64, seq=32)
        >>> outside_activation_bytes(m, micro_batch=3, dtype_bytes=4)
        75528
    """
    tokens = micro_batch * (model.seq // cp)
    rep = tp if sequence_parallel else 1
    total = 0
    if first:
        total += 8 * tokens + (8 * (model.seq // cp) if model.learned_positions else 0)   # int64 ids
    if last:
        h, stats = model.hidden, 2 if model.bias else 1
        total += tokens * (2 * h * dtype_bytes // rep + stats * 4 // rep)   # norm input + output, stats
        total += tokens * -(-model.vocab // tp) * 4 + 8          # log-softmax (fp32); the loss and its divisor
    return total


def inflight_microbatches(pp: int, stage: int, microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B: ``min(m, pp − stage)``.

    Example::

        >>> [inflight_microbatches(4, s, 8) for s in range(4)]       # the first stage holds the most
        [4, 3, 2, 1]
    """
    check_int("pp", pp, 1)
    check_int("stage", stage, 0, maximum=pp - 1)
    check_int("microbatches", microbatches, 1)
    return min(microbatches, pp - stage)


def split_problem(model: ModelSpec, config: ParallelConfig, global_batch: int) -> str | None:
    """Why ``config`` cannot split ``model`` (a sentence), or ``None`` when it can."""
    c = config
    checks = [
        (model.heads % c.tp, f"tp={c.tp} does not divide heads={model.heads}"),
        (model.kv_heads % c.tp, f"tp={c.tp} does not divide kv_heads={model.kv_heads}"),
        (model.ffn % c.tp, f"tp={c.tp} does not divide ffn={model.ffn}"),
        (c.pp > model.layers, f"pp={c.pp} is more stages than layers={model.layers}"),
        (model.seq % c.cp, f"cp={c.cp} does not divide seq={model.seq}"),
        (c.ep > 1 and model.experts == 1, f"ep={c.ep} but the model has no experts"),
        (model.experts % c.ep, f"ep={c.ep} does not divide experts={model.experts}"),
        (global_batch % (c.dp * c.ep), f"global_batch={global_batch} is not divisible by dp·ep={c.dp * c.ep}"),
    ]
    for bad, reason in checks:
        if bad:
            return reason
    local = global_batch // (c.dp * c.ep)
    if local % c.microbatches:
        return f"microbatches={c.microbatches} does not divide the batch per replica ({local})"
    return None


def stage_layers(layers: int, pp: int) -> list[int]:
    """Layers of each pipeline stage: ``layers // pp`` each, one more on the middle stages first (the
    first stage holds the most micro-batches under 1F1B, the last the logits) — as Llama 3 405B's 126
    layers on 16 stages (one layer fewer on the first and the last stage, section 3.3.2 of the paper).

    Example::

        >>> stage_layers(126, 16)
        [7, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 7]
        >>> stage_layers(8, 4), stage_layers(5, 2)
        ([2, 2, 2, 2], [2, 3])
    """
    check_int("pp", pp, 1)
    check_int("layers", layers, pp, hint=" (at least one layer per stage)")
    counts = [layers // pp] * pp
    order = list(range(1, pp - 1)) + ([pp - 1, 0] if pp > 1 else [0])      # middle, last, first
    for s in order[:layers % pp]:
        counts[s] += 1
    return counts


def stage_params(model: ModelSpec, config: ParallelConfig) -> list[dict[str, int]]:
    """Parameters one rank of each pipeline stage holds: ``{"dense": …, "expert": …}`` per stage.

    Matrices are split over ``tp`` (norms and row-parallel biases are not), experts over ``ep``,
    layers over ``pp``; the first stage holds the embedding (split over ``tp`` by vocabulary) and
    positions, the last the final norm and the head — a copy of the embedding when it is tied and
    ``pp > 1`` (Megatron-LM keeps the two copies equal by all-reducing their gradients).

    Example::

        >>> m = ModelSpec(layers=4, hidden=64, heads=4, ffn=256, vocab=64, seq=32, tied_embeddings=True)
        >>> sum(s["dense"] for s in stage_params(m, ParallelConfig())) == m.num_params()
        True
    """
    g, o, c = model.layer_param_groups(), model.outside_param_groups(), config
    per_stages = stage_layers(model.layers, c.pp)
    dense_layer = g["dense_split"] // c.tp + g["dense_replicated"]
    expert_layer = (model.experts // c.ep) * (g["expert_split"] // c.tp + g["expert_replicated"])
    emb = -(-o["embedding"] // c.tp)
    stages = []
    for s, per_stage in enumerate(per_stages):
        dense = per_stage * dense_layer
        if s == 0:
            dense += emb + o["positions"]
        if s == c.pp - 1:
            dense += o["final_norm"] + (-(-o["head"] // c.tp) if o["head"] else (emb if c.pp > 1 else 0))
        stages.append({"dense": dense, "expert": per_stage * expert_layer if model.experts > 1 else 0})
    if model.experts == 1:              # a dense model: its "MLP" is dense
        mlp = g["expert_split"] // c.tp + g["expert_replicated"]
        for st, per_stage in zip(stages, per_stages):
            st["dense"] += per_stage * mlp
    return stages


def model_state_bytes(num_params: int, shard_over: int, zero: int, dtype: str = "bf16") -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state for ``num_params`` shared by ``shard_over``
    ranks at ZeRO stage ``zero``: chapter 08's ``zero_memory_parts``, with ``dtype``'s bytes.

    Mixed precision (bf16/fp16) keeps 2 + 2 bytes and 12 of Adam state (fp32 master, m, v) per
    parameter; fp32 keeps 4 + 4 and 8 (m, v).

    Example::

        >>> model_state_bytes(1000, 4, 2)
        {'params': 2000, 'grads': 500, 'optimizer': 3000}
        >>> model_state_bytes(1000, 4, 0, "fp32")
        {'params': 4000, 'grads': 4000, 'optimizer': 8000}
    """
    check_choice("dtype", dtype, ("bf16", "fp16", "fp32"))
    k, scale = (8, 2) if dtype == "fp32" else (12, 1)
    parts = zero_memory_parts(num_params, shard_over, zero, k=k)
    return {"params": round(scale * parts["parameters"]), "grads": round(scale * parts["gradients"]),
            "optimizer": round(parts["optimizer state"])}
