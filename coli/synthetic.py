"""Seeded random-weight checkpoints of realistic MoE shapes, written with NumPy only.

- ``tiny``: a few MB, for tests.
- ``olmoe-mini``: hidden 1024, 8 layers, 16 heads, 32 experts top-4, expert
  intermediate 512, vocab 50304 (~0.5B parameters).
- ``olmoe-1b-7b``: the dimensions of OLMoE-1B-7B (hidden 2048, 16 layers, 64 experts
  top-8, expert intermediate 1024; ~6.9B parameters).

``write_hf`` writes a Hugging Face directory (bf16 safetensors, config.json, a
word-level tokenizer) that transformers, coli and the GGUF writer all read. For the
7B shape, whose bf16 files would take 14 GB, ``write_converted`` writes a converted
coli directory directly from random quantized codes.

The router weights are scaled per expert (a Zipf-like spread) so that, as in trained
models, some experts are routed to much more often than others; with uniform random
routers every expert would be equally hot and a cache could learn nothing.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from coli.quant import quantize, to_bf16
from coli.weights.converted import ConvertedWriter

SPECS = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 num_experts=8, num_experts_per_tok=2, intermediate_size=32, vocab_size=512),
    "olmoe-mini": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                       num_experts=32, num_experts_per_tok=4, intermediate_size=512, vocab_size=50304),
    "olmoe-1b-7b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                        num_experts=64, num_experts_per_tok=8, intermediate_size=1024, vocab_size=50304),
}
STD = 0.02
INT4_CODE_STD = float(np.sqrt(np.mean(np.arange(-7, 8) ** 2.0)))  # std of a uniform code in -7..7
# Token embeddings of write_converted's models: large enough that each token's own vector
# still steers routing in deep layers. With std STD the layers' outputs swamp it, attention
# averages them over the context, and every token routes to the same experts there.
EMBED_STD = 1.0
GENERATION = 2  # of write_converted's random codes; part of its fingerprint and of ensure's directory name


def config(name: str) -> dict:
    s = SPECS[name]
    return {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", **s,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "norm_topk_prob": False, "clip_qkv": None, "attention_bias": False,
            "hidden_act": "silu", "bos_token_id": None, "eos_token_id": 1, "pad_token_id": 1}


def tensor_shapes(name: str):
    """(name, shape, kind) of every tensor of the checkpoint, in file order."""
    c = SPECS[name]
    H, V, E, I = c["hidden_size"], c["vocab_size"], c["num_experts"], c["intermediate_size"]
    hd = H // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", (V, H), "w"
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (H,), "norm"
        yield f"{p}.post_attention_layernorm.weight", (H,), "norm"
        for n, shape in (("q_proj", (H, H)), ("k_proj", (kv, H)), ("v_proj", (kv, H)), ("o_proj", (H, H))):
            yield f"{p}.self_attn.{n}.weight", shape, "w"
        yield f"{p}.self_attn.q_norm.weight", (H,), "norm"
        yield f"{p}.self_attn.k_norm.weight", (kv,), "norm"
        yield f"{p}.mlp.gate.weight", (E, H), "router"
        for e in range(E):
            for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                yield f"{p}.mlp.experts.{e}.{n}.weight", shape, "w"
    yield "model.norm.weight", (H,), "norm"
    yield "lm_head.weight", (V, H), "w"


def _value(rng: np.random.Generator, shape, kind: str) -> np.ndarray:
    if kind == "norm":
        return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    w = (rng.standard_normal(shape) * STD).astype(np.float32)
    if kind == "router":  # expert e's logit scale ~ a Zipf-like spread: a few hot experts per layer
        scale = 1.0 + 3.0 / (1.0 + rng.permutation(shape[0]))  # (E,)
        w *= scale[:, None].astype(np.float32)
    return w


def write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "unk_token": "w0", "eos_token": "w1"}))


def write_hf(name: str, out: str | os.PathLike, seed: int = 0) -> Path:
    """A Hugging Face directory with bf16 weights (one safetensors file)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    entries, off = {}, 0
    shapes = list(tensor_shapes(name))
    for n, shape, _ in shapes:
        nbytes = int(np.prod(shape)) * 2
        entries[n] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)
    with open(tmp / "model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for n, shape, kind in shapes:
            f.write(to_bf16(_value(rng, shape, kind)).tobytes())
    cfg = config(name)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    write_tokenizer(tmp, cfg["vocab_size"])
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _random_quantized(rng: np.random.Generator, shape, fmt: str, std: float = STD):
    """A random matrix drawn directly as int4/int8 codes with float16 scales, so that
    writing a 7B model costs its bytes, not billions of float draws and roundings.
    The values spread like a normal weight of std ``std``, with zero mean: codes drawn
    uniformly over all 16 nibbles (-8..7) would give every matrix a mean of -0.5 scale
    steps, a shared direction that makes all tokens route alike in deep layers."""
    from coli._engine import kernels as K

    rows, cols = shape
    kp = K.padded(cols)
    int4 = fmt in ("int4", "int4s")
    d = np.full((rows, kp // 32), std / (INT4_CODE_STD if int4 else 50.0), dtype=np.float16)
    if int4:  # both nibbles uniform in 1..15, i.e. values -7..7: zero mean (int4: min -8 d)
        lo = rng.integers(1, 16, size=(rows, kp // 2), dtype=np.uint8)
        q = lo | (rng.integers(1, 16, size=(rows, kp // 2), dtype=np.uint8) << 4)
    else:
        q = np.clip(rng.normal(0, 50.0, size=(rows, kp)), -127, 127).astype(np.int8)
    mins = (d.astype(np.float32) * -8).astype(np.float16) if fmt == "int4" else None
    return K.QMatrix(K.FORMATS[fmt], q, d, rows, cols, mins)


def write_converted(name: str, out: str | os.PathLike, quant: str = "int4", seed: int = 0) -> Path:
    """A converted coli directory straight from random weights, never materialising the
    whole model in float: each tensor is drawn (directly as codes for int8/int4) and
    appended in turn. Its routing is meant to move like a trained model's: under varied
    input the busiest quarter of a layer's experts takes about 40-50% of the picks."""
    from coli.weights.source import default_head_quant

    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    head_quant = default_head_quant(quant)
    w = ConvertedWriter(tmp, quant, head_quant)
    experts: list = []
    layer = None
    for n, shape, kind in tensor_shapes(name):
        if ".mlp.experts." in n:
            layer = n.split(".experts.")[0]
            experts.append(_random_quantized(rng, shape, quant) if quant in ("int4", "int4s", "int8")
                           else quantize(_value(rng, shape, kind), quant))
            if len(experts) == 3 * SPECS[name]["num_experts"]:
                w.add_experts(layer, [tuple(experts[i : i + 3]) for i in range(0, len(experts), 3)])
                experts = []
            continue
        if kind == "w":
            fmt = head_quant if n in ("model.embed_tokens.weight", "lm_head.weight") else quant
            std = EMBED_STD if n == "model.embed_tokens.weight" else STD
            w.add_matrix(n, _random_quantized(rng, shape, fmt, std) if fmt in ("int4", "int4s", "int8")
                         else quantize(_value(rng, shape, kind) * (std / STD), fmt))
        else:
            w.add_f32(n, _value(rng, shape, kind))
    cfg = config(name)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    write_tokenizer(tmp, cfg["vocab_size"])
    w.finish(f"synthetic:{name}:seed{seed}:gen{GENERATION}", "olmoe")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def n_params(name: str) -> int:
    return sum(int(np.prod(s)) for _, s, _ in tensor_shapes(name))


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "coli" / "synthetic"


def ensure(name: str, quant: str, seed: int = 0) -> Path:
    """The synthetic model ``name`` at ``quant``, written once into the cache directory.

    Small shapes go through a Hugging Face directory and ``coli convert`` (the same
    path a user's model takes); the 7B shape is written converted directly."""
    from coli.weights.convert import convert

    if name not in SPECS:
        raise KeyError(name)
    root = cache_dir()
    conv = root / f"{name}-{quant}-s{seed}"
    if name == "olmoe-1b-7b":  # written directly, so its name carries the generator's version
        conv = root / f"{name}-{quant}-s{seed}-g{GENERATION}"
        return conv if (conv / "coli.json").exists() else write_converted(name, conv, quant, seed)
    if (conv / "coli.json").exists():
        return conv
    hf = root / f"{name}-hf-s{seed}"
    if not (hf / "config.json").exists():
        write_hf(name, hf, seed)
    return convert(hf, conv, quant, force=True)


