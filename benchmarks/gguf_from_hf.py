"""Write a GGUF (llama.cpp's format) of a Hugging Face OLMoE checkpoint, such as coli's
synthetic ``olmoe-mini`` (``coli.synthetic.write_hf``), so llama.cpp can run the very
same weights for a side-by-side benchmark.

    python benchmarks/gguf_from_hf.py HF_DIR OUT.gguf --type q4_0   # or q4_1, q8_0, f32

What it writes (what llama.cpp's ``convert_hf_to_gguf.py`` writes for
``OlmoeForCausalLM``, arch ``olmoe``):

* tensors under llama.cpp's names (``gguf.TENSOR_NAMES`` of ``gguf.MODEL_ARCH.OLMOE``):
  ``token_embd``, ``blk.N.attn_{q,k,v,output}``, ``blk.N.attn_{q,k}_norm`` (RMSNorm
  over the whole projection, as OLMoE does), ``blk.N.attn_norm``, ``blk.N.ffn_norm``,
  ``blk.N.ffn_gate_inp`` (router), the experts stacked into 3-D
  ``blk.N.ffn_{gate,up,down}_exps`` (numpy shape (E, rows, cols), expert order kept),
  ``output_norm``, ``output``;
* no q/k permutation: llama.cpp runs OLMoE with NEOX-style RoPE (rotate-half, the HF
  layout), so the HF q/k rows are used as they are;
* ``--type`` sets the format of every 2-D+ weight matrix, *including* ``token_embd`` and
  ``output`` (llama.cpp's own quantizer would keep the output at a higher type; here the
  point is equal bytes with coli's format). Norms and the router stay F32;
* a minimal SentencePiece-style ("llama") vocabulary of the checkpoint's word tokens
  (``w0`` ... ``wN``): the benchmark feeds token ids, so the vocabulary only has to load.

Quantization is ``gguf.quants.quantize`` (NumPy reference of ggml's Q4_0 / Q8_0:
32-element blocks with an f16 scale -- the same block layout as coli's int4 / int8).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

TYPES = {"f32": "F32", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}
FILE_TYPES = {"f32": "ALL_F32", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1"}


def _checkpoint(hf_dir: Path):
    # coli's mmap safetensors reader (bf16 widened to f32); read-only use of coli.
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH
    from coli.weights.safetensors import Checkpoint

    return Checkpoint(hf_dir)


def write_vocab(w, vocab_size: int, eos: int | None) -> None:
    import gguf

    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"w{i}" for i in range(vocab_size)])
    w.add_token_scores([0.0] * vocab_size)
    types = [int(gguf.TokenType.NORMAL)] * vocab_size
    types[0] = int(gguf.TokenType.UNKNOWN)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    if eos is not None:
        w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)


def convert(hf_dir: str | Path, out: str | Path, qtype: str = "q4_0", log=print) -> Path:
    import gguf
    from gguf import GGMLQuantizationType as Q

    hf_dir, out = Path(hf_dir), Path(out)
    cfg = json.loads((hf_dir / "config.json").read_text())
    if cfg.get("model_type") != "olmoe":
        raise SystemExit(f"{hf_dir}: model_type {cfg.get('model_type')!r}, this writer handles 'olmoe'")
    if cfg.get("norm_topk_prob"):
        raise SystemExit("norm_topk_prob=True: llama.cpp's olmoe graph does not renormalize top-k weights")
    if cfg.get("clip_qkv") is not None:
        raise SystemExit("clip_qkv is set: llama.cpp's olmoe graph has no clamp of q/k/v")
    ck = _checkpoint(hf_dir)
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    E, V = cfg["num_experts"], cfg["vocab_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    qt = getattr(Q, TYPES[qtype])

    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.OLMOE]  # "olmoe"
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(hf_dir.name)
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    w.add_expert_count(E)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_vocab_size(V)
    w.add_file_type(int(getattr(gguf.LlamaFileType, FILE_TYPES[qtype])))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    eos = cfg.get("eos_token_id")
    write_vocab(w, V, eos if isinstance(eos, int) else None)

    def mat(name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if qt == Q.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)  # shape from the byte shape

    def f32(name: str, arr: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))

    t0 = time.perf_counter()
    mat("token_embd.weight", ck.f32("model.embed_tokens.weight", (V, H)))
    for i in range(L):
        p = f"model.layers.{i}"
        f32(f"blk.{i}.attn_norm.weight", ck.f32(f"{p}.input_layernorm.weight"))
        for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            mat(f"blk.{i}.{gg}.weight", ck.f32(f"{p}.self_attn.{hf}.weight"))
        f32(f"blk.{i}.attn_q_norm.weight", ck.f32(f"{p}.self_attn.q_norm.weight"))
        f32(f"blk.{i}.attn_k_norm.weight", ck.f32(f"{p}.self_attn.k_norm.weight"))
        f32(f"blk.{i}.ffn_norm.weight", ck.f32(f"{p}.post_attention_layernorm.weight"))
        f32(f"blk.{i}.ffn_gate_inp.weight", ck.f32(f"{p}.mlp.gate.weight", (E, H)))
        for hf, gg in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            stacked = np.stack([ck.f32(f"{p}.mlp.experts.{e}.{hf}.weight") for e in range(E)])  # (E, rows, cols)
            mat(f"blk.{i}.{gg}.weight", stacked)
        log(f"  layer {i + 1}/{L} ({time.perf_counter() - t0:.0f}s)")
    f32("output_norm.weight", ck.f32("model.norm.weight", (H,)))
    if cfg.get("tie_word_embeddings") or "lm_head.weight" not in ck:
        pass  # llama.cpp falls back to token_embd when `output` is absent
    else:
        mat("output.weight", ck.f32("lm_head.weight", (V, H)))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    log(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB, {TYPES[qtype]}) in {time.perf_counter() - t0:.0f}s")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir")
    ap.add_argument("out")
    ap.add_argument("--type", choices=list(TYPES), default="q4_0")
    a = ap.parse_args(argv)
    convert(a.hf_dir, a.out, a.type, log=lambda s: print(s, file=sys.stderr))


if __name__ == "__main__":
    main()
