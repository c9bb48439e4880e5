"""The text TinyGPT learns: generated offline, character-level, learnable in a few hundred steps.

A small grammar writes sentences about parallel training ("the ring all-reduces the gradients
on every rank."); words, order and punctuation follow rules a tiny model can pick up, so the loss
falls visibly from ``ln(vocab)`` within minutes on a CPU. Nothing is downloaded; the same ``seed``
gives the same text on every machine and every rank.

``TinyText`` holds the text, the character vocabulary, the tokens, and deterministic batches::

    data = TinyText()
    x, y = data.batch(8, 32, step=0)      # (8, 32) inputs, (8, 32) targets shifted by one
"""

from __future__ import annotations

import random

import torch

from ..runtime import check_int

__all__ = ["TinyText"]

_SUBJECTS = ["the ring", "every rank", "the pipeline", "a worker", "the optimizer", "rank zero", "the mesh",
             "each device", "the scheduler", "the model"]
_VERBS = ["sends", "receives", "reduces", "gathers", "splits", "shards", "scatters", "averages", "copies",
          "checks"]
_OBJECTS = ["the gradients", "a tensor", "the activations", "its shard", "the weights", "the loss",
            "every column", "each row", "the batch", "the logits"]
_PLACES = ["on every step", "across the node", "to its neighbour", "before the update", "in one message",
           "along the ring", "after the forward pass", "during backward"]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
    if rng.random() < 0.6:
        words.append(rng.choice(_PLACES))
    return " ".join(words) + rng.choice([". ", ". ", ". ", "! ", "? "])


class TinyText:
    """A generated English-like text, its characters as tokens, and batches of it.

    Args:
        num_chars: length of the text in characters (at least 64).
        seed: the text's seed (every rank that uses the same seed gets the same text).

    Example::

        >>> data = TinyText(num_chars=2000)
        >>> data.text[:39]
        'the mesh scatters the gradients during '
        >>> data.vocab_size, len(data.tokens)
        (27, 2000)
        >>> data.decode(data.encode("the ring"))
        'the ring'
        >>> x, y = data.batch(4, 16, step=3)        # (B, T) inputs and next-character targets
        >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
        (torch.Size([4, 16]), True)

    .. warning::
        ``batch(..., step=k)`` is a function of ``(seed, step)`` only, so every rank can draw the
        *global* batch and keep its own rows (what data parallelism needs). Drawing with a shared
        global RNG instead would give different ranks different batches.
    """

    def __init__(self, num_chars: int = 20_000, seed: int = 0):
        check_int("num_chars", num_chars, 64)
        check_int("seed", seed)
        rng = random.Random(seed)
        parts, length = [], 0
        while length < num_chars:
            s = _sentence(rng)
            parts.append(s)
            length += len(s)
        self.text = "".join(parts)[:num_chars]
        self.seed = seed
        self.vocab = sorted(set("".join(_SUBJECTS + _VERBS + _OBJECTS + _PLACES) + ".!? "))
        self._index = {c: i for i, c in enumerate(self.vocab)}
        self.tokens = self.encode(self.text)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        """Characters → token ids (int64); an unknown character is a ``ValueError``."""
        unknown = sorted(set(text) - self._index.keys())
        if unknown:
            raise ValueError(f"characters {unknown} are not in the vocabulary {''.join(self.vocab)!r}")
        return torch.tensor([self._index[c] for c in text], dtype=torch.int64)

    def decode(self, ids) -> str:
        """Token ids → text."""
        return "".join(self.vocab[int(i)] for i in ids)

    def batch(self, batch_size: int, seq_len: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows of ``seq_len`` characters and their next characters.

        Returns ``(x, y)``, both ``(batch_size, seq_len)`` int64, with ``y[:, t] = x[:, t + 1]``'s
        successor in the text. Deterministic in ``(seed, step)``.
        """
        check_int("batch_size", batch_size, 1)
        check_int("seq_len", seq_len, 1, maximum=len(self.tokens) - 1, hint=" (the text's length - 1)")
        check_int("step", step, 0)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - seq_len, (batch_size,), generator=g)
        windows = torch.stack([self.tokens[s:s + seq_len + 1] for s in starts.tolist()])   # (B, T+1)
        return windows[:, :-1], windows[:, 1:]
