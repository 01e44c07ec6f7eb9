"""Token sampling: penalties, temperature, top-k, top-p, min-p, and a seeded RNG per request.

Semantics follow Hugging Face's logits processors (RepetitionPenalty, Temperature, TopK, TopP, MinP,
applied in that order) plus OpenAI's presence/frequency penalties. Everything is vectorized NumPy
over the vocabulary; the candidate set shrinks as early as possible so that a full sort of the
vocabulary is rarely needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coli.errors import InvalidRequestError

_BLOCK = 1024  # tokens per block in the two-level inverse-CDF draw
_GREEDY_BELOW = 1e-5  # smaller temperatures are greedy (as in vLLM); dividing by them can overflow


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. The defaults sample from the model's plain distribution."""

    temperature: float = 1.0  # 0 (or below 1e-5) => greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # 0 => off
    min_p: float = 0.0  # drop tokens less likely than min_p * (the top token's probability)
    seed: int | None = None  # None => fresh entropy
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted once per occurrence
    repetition_penalty: float = 1.0  # HF/CTRL: divides positive (multiplies negative) logits of seen tokens

    def validate(self) -> None:
        """Raises InvalidRequestError naming the first field out of range."""
        _check_number("temperature", self.temperature, lambda v: v >= 0, "must be >= 0")
        _check_number("top_p", self.top_p, lambda v: 0 < v <= 1, "must be in (0, 1]")
        _check_number("min_p", self.min_p, lambda v: 0 <= v <= 1, "must be in [0, 1]")
        _check_number("presence_penalty", self.presence_penalty, lambda v: -2 <= v <= 2, "must be in [-2, 2]")
        _check_number("frequency_penalty", self.frequency_penalty, lambda v: -2 <= v <= 2, "must be in [-2, 2]")
        _check_number("repetition_penalty", self.repetition_penalty, lambda v: v > 0, "must be > 0")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise InvalidRequestError(f"seed must be an integer >= 0, got {self.seed!r}")


class Sampler:
    """Picks tokens for one request; owns a NumPy Generator seeded from ``params.seed`` (or fresh entropy).

    Same seed and same sequence of logits => same tokens.
    """

    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        # every pick is greedy(logits): a caller may take one argmax over a batch's rows instead
        self.is_greedy = (params.temperature < _GREEDY_BELOW and params.repetition_penalty == 1.0
                          and not params.presence_penalty and not params.frequency_penalty)

    def sample(self, logits: np.ndarray, generated: Sequence[int] = (), allowed: np.ndarray | None = None) -> int:
        """Returns the next token id.

        ``logits``: (vocab,) scores for the next position. ``generated``: the ids the penalties count
        (the caller decides whether the prompt is included). ``allowed``: (vocab,) bool, a constraint's
        mask (coli.grammar): the other tokens get -inf before anything else, so temperature, top_k,
        top_p and min_p see the constrained distribution; a mask allowing one token returns it without
        a draw (the seeded stream is the same whether forced tokens are folded or not). Penalties
        apply first; then greedy if temperature is 0 (below 1e-5), else temperature -> top_k ->
        top_p -> min_p and one draw from the Generator.
        """
        p = self.params
        x = np.asarray(logits, dtype=np.float32).reshape(-1)  # (V,) not modified in place
        if allowed is not None:
            x, only = apply_mask(x, allowed)
            if only is not None:
                return only
        if len(generated) and (p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty):
            x = x.copy()
            apply_penalties(x, generated, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        if p.temperature < _GREEDY_BELOW:
            return greedy(x)
        ids, weights = _filter(x / np.float32(p.temperature), p.top_k, p.top_p, p.min_p)  # (n,), (n,)
        j = _draw(weights, self.rng.random())
        return j if ids is None else int(ids[j])


def apply_mask(x: np.ndarray, allowed: np.ndarray) -> tuple[np.ndarray, int | None]:
    """``x`` (V,) with the tokens ``allowed`` (V,) bool does not allow at -inf (a new array), and
    the only allowed id when there is exactly one. Raises ValueError when none is allowed."""
    ok = np.asarray(allowed, dtype=bool)[: x.shape[0]]
    ids = np.flatnonzero(ok) if ok.sum() <= 1 else None
    if ids is not None:
        if not ids.size:
            raise ValueError("the constraint allows no token")
        return x, int(ids[0])
    return np.where(ok, x, np.float32(-np.inf)).astype(np.float32, copy=False), None


def apply_penalties(
    x: np.ndarray,
    generated: Sequence[int],
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
) -> None:
    """Penalizes ``x`` (vocab,) in place for the tokens in ``generated``.

    HF repetition penalty: a seen token's logit is divided by the penalty if positive, multiplied if
    negative. OpenAI: ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``.
    """
    seen, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)  # (u,), (u,)
    if seen.size and (seen[0] < 0 or seen[-1] >= x.shape[-1]):
        raise ValueError(f"generated ids must lie in [0, {x.shape[-1]}), got {int(seen[0])}..{int(seen[-1])}")
    if repetition_penalty != 1.0:
        s = x[seen]  # (u,)
        x[seen] = np.where(s < 0, s * repetition_penalty, s / repetition_penalty)
    if frequency_penalty or presence_penalty:
        x[seen] -= counts * frequency_penalty + presence_penalty


def greedy(logits: np.ndarray) -> int:
    """The id of the largest logit; ties go to the lowest id (as torch.argmax)."""
    return int(np.argmax(logits))


def logprobs(logits: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis, computed stably in float64, returned as float32."""
    x = np.asarray(logits, dtype=np.float64)  # (..., V)
    m = np.max(x, axis=-1, keepdims=True)  # (..., 1)
    z = x - m
    return (z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))).astype(np.float32)


def _filter(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> tuple[np.ndarray | None, np.ndarray]:
    """Applies top_k -> top_p -> min_p to scaled logits x (V,) float32.

    Returns the kept ids (n,), or None for all of them in order, and their unnormalized probabilities
    (n,) float32. Each step sees the distribution renormalized over what the previous steps kept, as
    in HF. Vocabulary-wide work stays in float32 (SIMD exp) and avoids gathering or copying the
    vocabulary: at 150k ids every extra pass costs about 0.1 ms.
    """
    vocab = x.shape[0]
    ids = None  # None: every id, in order (avoids gathering the whole vocabulary)
    if 0 < top_k < vocab:
        kth = np.partition(x, vocab - top_k)[vocab - top_k]  # the k-th largest; ties with it are kept (HF)
        ids = np.flatnonzero(x >= kth)  # (n,)
        x = x[ids]
    top = x.max()  # NaN if any logit is NaN
    if not np.isfinite(top):
        raise ValueError("sampling: logits contain NaN or +inf, or are all -inf")
    weights = np.exp(x - top)  # (n,) unnormalized, the largest is 1
    total = weights.sum(dtype=np.float64)
    if top_p < 1.0:
        order = _top_p_order(weights, top_p * total)  # (m,) most probable first
        w = weights[order].astype(np.float64)  # (m,)
        keep = order[np.cumsum(w) - w < top_p * total]  # mass ranked strictly above each token < top_p
        ids = keep if ids is None else ids[keep]
        weights = weights[keep]
    if min_p > 0.0:
        keep = np.flatnonzero(weights >= min_p * weights.max())  # the top token always survives
        ids = keep if ids is None else ids[keep]
        weights = weights[keep]
    return ids, weights


def _draw(weights: np.ndarray, u: float) -> int:
    """Index i with probability weights[i] / weights.sum(), by inverse CDF at u in [0, 1).

    Two levels, block sums and then one block's cumsum, because a float64 cumsum over a 150k
    vocabulary costs more than everything else in sampling. Never returns a weight of 0.
    """
    starts = np.arange(0, weights.shape[0], _BLOCK)  # (nb,)
    cdf = np.cumsum(np.add.reduceat(weights, starts, dtype=np.float64))  # (nb,)
    target = min(u * cdf[-1], np.nextafter(cdf[-1], 0.0))
    b = int(np.searchsorted(cdf, target, side="right"))  # cdf[b] > target: block b has mass
    inner = np.cumsum(weights[starts[b] : starts[b] + _BLOCK], dtype=np.float64)  # (<=_BLOCK,)
    rest = min(max(target - (cdf[b - 1] if b else 0.0), 0.0), np.nextafter(inner[-1], 0.0))
    return int(starts[b]) + int(np.searchsorted(inner, rest, side="right"))


def _top_p_order(weights: np.ndarray, mass: float) -> np.ndarray:
    """Indices of the largest entries of weights (n,), largest first, enough to hold ``mass`` of them.

    The kept set is a prefix of the descending order, so when the m largest already hold the mass only
    they need sorting (argpartition is O(n)); for a peaked distribution m = 256 suffices.
    """
    n = weights.shape[0]
    m = 256
    while m < n:
        head = np.argpartition(weights, n - m)[n - m :]  # (m,) the m largest, unordered
        if weights[head].sum(dtype=np.float64) >= mass:
            return head[np.argsort(-weights[head])]
        m *= 8
    return np.argsort(-weights)


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check_number(name: str, value: object, ok, rule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or not ok(value):
        raise InvalidRequestError(f"{name} {rule}, got {value!r}")
