"""A draft model: a small model with the target's tokenizer proposes k tokens greedily.

It keeps a KV cache per runner slot. Drafting for several requests runs batched: one
step feeds each request's tokens that its draft cache lacks (the new output, or the
whole prompt the first time), then k - 1 one-token steps extend every draft. A draft
cache is cut back to its common prefix with the request's context first, so rejected
draft tokens are forgotten the same way the target's are.
"""
from __future__ import annotations

import time

import numpy as np

from coli.api import common_prefix
from coli.errors import InvalidRequestError


def check_tokenizers(target, draft) -> None:
    """InvalidRequestError unless the draft model's tokenizer gives the target's ids."""
    a, b = target.tokenizer, draft.tokenizer
    if a._backend.get_vocab(with_added_tokens=True) != b._backend.get_vocab(with_added_tokens=True):
        raise InvalidRequestError(f"--draft-model {draft.path}: its tokenizer differs from the model's "
                                  "(speculation needs the same token ids)")
    if draft.config.vocab_size < target.config.vocab_size and draft.config.vocab_size < a.vocab_size:
        raise InvalidRequestError(f"--draft-model {draft.path}: its vocabulary ({draft.config.vocab_size}) is "
                                  f"smaller than the model's ({target.config.vocab_size})")


class DraftSource:
    def __init__(self, target, draft, slots: int):
        check_tokenizers(target, draft)
        self.model, self.engine = draft, draft.engine
        self.vocab = target.config.vocab_size
        self.caches = [self.engine.new_cache() for _ in range(slots)]
        self.seconds_per_token = 0.0  # measured: drafting time per drafted token

    def propose(self, items: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """items: (slot, context, k) -> each one's greedy draft of up to k tokens."""
        t0 = time.perf_counter()
        entries, keep = [], []
        for slot, ctx, k in items:
            if len(ctx) + k > self.engine.max_context:
                continue
            cache = self.caches[slot]
            n = min(common_prefix(cache.tokens, ctx), len(ctx) - 1)
            cache.truncate(n)
            entries.append((cache, list(ctx[n:])))
            keep.append((slot, k))
        drafts: dict[int, list[int]] = {slot: [] for slot, _ in keep}
        if entries:
            logits = self.engine.step(entries)
            for (slot, k), row in zip(keep, self._picks(logits)):
                drafts[slot].append(row)
            while True:
                live = [(slot, k) for slot, k in keep if len(drafts[slot]) < k]
                if not live:
                    break
                logits = self.engine.step([(self.caches[slot], [drafts[slot][-1]]) for slot, _ in live])
                for (slot, _), row in zip(live, self._picks(logits)):
                    drafts[slot].append(row)
        made = sum(len(d) for d in drafts.values())
        if made:
            per = (time.perf_counter() - t0) / made
            self.seconds_per_token = per if not self.seconds_per_token else 0.8 * self.seconds_per_token + 0.2 * per
        return [drafts.get(slot, []) for slot, _, _ in items]

    def _picks(self, logits: np.ndarray) -> list[int]:
        return logits[:, : self.vocab].argmax(axis=1).tolist()
