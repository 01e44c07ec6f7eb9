"""The tokenizer of a GGUF file, rebuilt from its metadata as a ``tokenizers`` pipeline.

Two vocabulary kinds, as llama.cpp names them in ``tokenizer.ggml.model``:

* ``gpt2``: byte-level BPE from ``tokens`` and ``merges``; the pre-tokenizer (how text
  is split before BPE) follows ``tokenizer.ggml.pre`` with llama.cpp's own table
  (``smollm``/``starcoder``: GPT-2 plus one-digit numbers, ``qwen2``, ``llama-bpe``
  patterns, else GPT-2's).
* ``llama``: a SentencePiece vocabulary (``tokens`` + ``scores``), turned into BPE with
  merges ranked by score (what ``tokenizers``' SentencePiece extractor does), byte
  fallback, ``▁`` for spaces and the dummy prefix unless ``add_space_prefix`` is false.

Tokens typed CONTROL become special added tokens and USER_DEFINED plain added ones;
BOS/EOS are added as ``add_bos_token`` / ``add_eos_token`` say; the chat template is
``tokenizer.chat_template``. Ids equal the original Hugging Face tokenizer's.
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from coli.errors import ModelLoadError
from coli.tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PATTERNS = {"llama-bpe": LLAMA3, "llama3": LLAMA3, "qwen2": QWEN2, "deepseek-r1-qwen": QWEN2}
DIGITS = ("smollm", "starcoder", "refact")


def _byte_level_pre(pre: str):
    if pre in PATTERNS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PATTERNS[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in DIGITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary: every split of a token into two tokens,
    ranked by the token's score (highest first), ties by the pieces' ids."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in sorted(zip(tokens, scores), key=lambda x: -x[1]):
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda x: -x[2])  # stable: keeps the id order within equal scores
    return [(a, b) for a, b, _ in merges]


def tokenizer_from_gguf(g) -> Tokenizer:
    """The coli Tokenizer of an opened ``coli.weights.gguf.GGUFModel``."""
    kind = g.get("tokenizer.ggml.model")
    tokens = g.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{g.path}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens is missing)")
    types = g.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}

    def special(key):
        i = g.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges") or []]
        backend = Backend(models.BPE(vocab, merges, fuse_unk=False))
        backend.pre_tokenizer = _byte_level_pre(str(g.get("tokenizer.ggml.pre") or "default"))
        backend.decoder = decoders.ByteLevel()
        add_bos_default = False
    elif kind == "llama":
        scores = g.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = _spm_merges(tokens, scores)
        backend = Backend(models.BPE(vocab, merges, unk_token=special("unknown") or special("unk"),
                                     fuse_unk=True, byte_fallback=True))
        prefix = bool(g.get("tokenizer.ggml.add_space_prefix", True))
        norms = ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")]
        backend.normalizer = normalizers.Sequence(norms)
        dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        backend.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        add_bos_default = True
    else:
        raise ModelLoadError(f"{g.path}: tokenizer model {kind!r} is not supported (supported: gpt2, llama)")

    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == CONTROL])
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if user:
        backend.add_tokens(user)
    bos, eos = special("bos"), special("eos")
    pieces = []
    if g.get("tokenizer.ggml.add_bos_token", add_bos_default) and bos:
        pieces.append(bos)
    single, pair = [*pieces, "$A"], [*pieces, "$A", *pieces, "$B"]
    if g.get("tokenizer.ggml.add_eos_token", False) and eos:
        single, pair = single + [eos], pair + [eos]
    used = sorted({t for t in single + pair if not t.startswith("$")})
    if used:
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(f"{t}:0" if not t.startswith("$") else t for t in single),
            pair=" ".join(f"{t}:1" if not t.startswith("$") else t + ":1" if t == "$B" else t for t in pair),
            special_tokens=[(t, vocab[t]) for t in used])
    elif kind == "gpt2":
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    named = {f"{k}_token": special(k) for k in ("bos", "eos", "padding", "unknown")}
    named = {{"padding_token": "pad_token", "unknown_token": "unk_token"}.get(k, k): v
             for k, v in named.items() if v is not None}
    template = g.get("tokenizer.chat_template")
    return Tokenizer(backend, special_tokens=named, chat_template=template if isinstance(template, str) else None,
                     eos_token_ids=[vocab[eos]] if eos else [])
