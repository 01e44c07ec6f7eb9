"""GGUF files loaded directly: each architecture written as llama.cpp writes it (tests/gguf_kit.py)
from the tiny seeded checkpoints, against the same checkpoint loaded from safetensors; Q8_0 and
Q4_0/Q4_1 repacked bit for bit; the other types within their error; bad files refused in one line."""
from __future__ import annotations

import os

import numpy as np
import pytest

import coli
from coli.errors import ModelLoadError
from coli.quant import dequantize, quantize
from coli.weights.gguf import GGUFModel, GGUFWeights, repack
from tests.conftest import ARCHS, make_hf_model, prompt_ids
from tests.gguf_kit import write_gguf

gguf = pytest.importorskip("gguf", reason="GGUF support needs the gguf package (pip install gguf)")

ARCH_CASES = ["llama", "qwen2", "qwen3", "mixtral", "olmoe", "qwen3_moe", "gemma3_text", "llama-rope-linear",
              "llama-rope-llama3", "qwen2-rope-yarn", "deepseek_v3", "deepseek_v3-no-q-lora", "glm4_moe"]
KIT = {"glm4_moe": dict(nextn=1)}  # GLM-4.5 GGUFs carry their MTP block after the decoder's: skipped


# llama.cpp's gemma3 scales queries by 1/sqrt(head_dim): the GGUF has no query_pre_attn_scalar
EXTRA = {"gemma3_text": ("gemma3_text", dict(ARCHS["gemma3_text"][1], query_pre_attn_scalar=32)),
         "qwen3-256": ("qwen3", dict(hidden_size=256, intermediate_size=256, head_dim=64, num_hidden_layers=1))}


@pytest.fixture(scope="module")
def models(hf_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-gguf")

    def get(name):
        if name not in EXTRA:
            return hf_models(name)
        if not (root / name / "config.json").exists():
            mt, ov = EXTRA[name]
            make_hf_model(mt, root / name, **ov)
        return root / name

    return get


@pytest.fixture(scope="module")
def ggufs(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    made = {}

    def get(name, qtype="F32"):
        if (name, qtype) not in made:
            made[name, qtype] = write_gguf(models(name), root / f"{name}-{qtype}.gguf", qtype, **KIT.get(name, {}))
        return made[name, qtype]

    return get


@pytest.mark.parametrize("name", ARCH_CASES)
def test_f32_gguf_matches_safetensors(name, models, ggufs):
    ids = prompt_ids(12)
    ref = coli.load(models(name), threads=1).forward(ids)
    m = coli.load(ggufs(name), threads=1)
    got = m.forward(ids)
    assert np.abs(got - ref).max() <= 1e-4, f"{name}: max |diff| {np.abs(got - ref).max():.2e}"


@pytest.mark.parametrize("qtype,fmt", [("Q8_0", "int8"), ("Q4_0", "int4s"), ("Q4_1", "int4")])
@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_q8_0_q4_0_and_q4_1_are_repacked_bit_for_bit(name, qtype, fmt, hf_models, ggufs, tmp_path):
    """The GGUF's blocks become coli's int8/int4s/int4 arrays unchanged (scale, min and
    nibbles); what they stand for equals the GGUF's dequantized values exactly."""
    g = GGUFModel(ggufs(name, qtype))
    w = GGUFWeights(g)
    assert (w.quant, w.head_quant) == (fmt, fmt)
    t = g.tensors["blk.0.attn_v.weight"]
    m = w.matrix("model.layers.0.self_attn.v_proj.weight", int(t.shape[1]), int(t.shape[0]))
    size, head = {"Q8_0": (34, 2), "Q4_0": (18, 2), "Q4_1": (20, 4)}[qtype]
    raw = np.asarray(t.data).reshape(int(t.shape[1]), -1, size)
    assert np.array_equal(m.scales.view(np.uint16), raw[..., :2].copy().view(np.uint16)[..., 0])
    if qtype == "Q4_1":
        assert np.array_equal(m.mins.view(np.uint16), raw[..., 2:4].copy().view(np.uint16)[..., 0])
    assert np.array_equal(m.data.view(np.uint8).reshape(raw.shape[0], raw.shape[1], -1), raw[..., head:])
    deq = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    assert np.array_equal(dequantize(m), deq)
    ids = prompt_ids(10)
    got = coli.load(ggufs(name, qtype), threads=1).forward(ids)
    deq = _rewrite(ggufs(name, qtype), tmp_path / "deq.gguf", lambda n, t: _dequantized(t))
    if qtype != "Q4_1":
        # end to end: the same logits as the GGUF's dequantized values quantized by coli itself
        # (exact: a Q8_0/Q4_0 block's largest weight gives back its own scale), so no second rounding
        assert np.array_equal(got, coli.load(deq, threads=1, quant=fmt, head_quant=fmt).forward(ids))
        near = coli.load(hf_models(name), threads=1, quant=fmt).forward(ids)  # coli's own quantizer: close
        assert np.abs(got - near).max() < 1.0
    else:  # the file's own values: only the activations' int8 rounding differs from f32 over them
        exact = coli.load(deq, threads=1, quant="f32").forward(ids)
        assert np.abs(got - exact).max() < 0.25, np.abs(got - exact).max()


@pytest.mark.parametrize("qtype,fmt", [("Q8_0", "int8"), ("Q4_0", "int4s")])
@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_sigmoid_moe_archs_repack_bit_for_bit(name, qtype, fmt, ggufs, tmp_path):
    """deepseek2 (MLA) and glm4moe: routed and shared experts and the MLA projections come
    from the GGUF's blocks unchanged; logits equal those of the GGUF's dequantized values
    quantized by coli (the same codes: no second rounding)."""
    g = GGUFModel(ggufs(name, qtype))
    w = GGUFWeights(g)
    assert w.quant == fmt
    t = g.tensors["blk.1.ffn_down_exps.weight"]
    E, H, I = (int(d) for d in t.shape[::-1])
    (_, _, down), *_ = w.expert_matrices("model.layers.1.mlp", E, H, I, fmt)
    size = {"Q8_0": 34, "Q4_0": 18}[qtype]
    raw = np.asarray(t.data).reshape(E, H, -1, size)[0]
    assert np.array_equal(down.scales.view(np.uint16), raw[..., :2].copy().view(np.uint16)[..., 0])
    assert np.array_equal(down.data.view(np.uint8).reshape(H, raw.shape[1], -1), raw[..., 2:])
    shared = "blk.1.ffn_up_shexp.weight"
    m = w.matrix("model.layers.1.mlp.shared_experts.up_proj.weight", int(g.tensors[shared].shape[1]),
                 int(g.tensors[shared].shape[0]))
    assert np.array_equal(dequantize(m), _dequantized(g.tensors[shared]))
    ids = prompt_ids(10)
    got = coli.load(ggufs(name, qtype), threads=1).forward(ids)
    deq = _rewrite(ggufs(name, qtype), tmp_path / "deq.gguf", lambda n, t: _dequantized(t))
    assert np.array_equal(got, coli.load(deq, threads=1, quant=fmt, head_quant=fmt).forward(ids))


def test_deepseek2_reads_the_older_whole_kv_b(models, ggufs, tmp_path):
    """GGUFs converted before llama.cpp split kv_b_proj into attn_k_b / attn_v_b keep it whole."""
    old = write_gguf(models("deepseek_v3"), tmp_path / "old.gguf", "F32", split_kv_b=False)
    assert "blk.0.attn_kv_b.weight" in GGUFModel(old).tensors
    assert "blk.0.attn_k_b.weight" in GGUFModel(ggufs("deepseek_v3")).tensors
    ids = prompt_ids(8)
    assert np.array_equal(coli.load(old, threads=1).forward(ids), coli.load(ggufs("deepseek_v3"), threads=1).forward(ids))


def test_glm4moe_mtp_block_is_skipped(ggufs, models):
    g = GGUFModel(ggufs("glm4_moe"))
    cfg = g.config()
    assert g.get(".block_count") == cfg.num_hidden_layers + 1 and "blk.3.nextn.eh_proj.weight" in g.tensors
    assert cfg.partial_rotary_factor == 0.5 and cfg.raw["use_qk_norm"] and cfg.raw["n_shared_experts"] == 1


def test_deepseek2_with_softmax_gating_is_refused(models, tmp_path):
    path = write_gguf(models("deepseek_v3"), tmp_path / "v2.gguf", "F32")
    src = GGUFModel(path)
    out = _rewrite(path, tmp_path / "soft.gguf", lambda n, t: np.asarray(t.data),
                   meta=lambda k, v: 1 if k == "deepseek2.expert_gating_func" else v)
    assert src.get(".expert_gating_func") == 2
    with pytest.raises(ModelLoadError, match="softmax expert gating .* not supported"):
        coli.load(out)


def test_repack_keeps_q4_0_nibble_order():
    """ggml's Q4_0: byte j of a block = element j (low nibble) | element j + 16 (high) — coli's order."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    m = repack(blocks, "Q4_0", 3, 64)
    assert np.array_equal(dequantize(m), gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0))
    assert np.abs(dequantize(quantize(w, "int4s")) - dequantize(m)).max() < 0.5


def _dequantized(t) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)


def _rewrite(src_path, out, tensor, meta=None):
    """A copy of a GGUF with every tensor replaced by ``tensor(name, reader_tensor)``
    (an array, or (bytes, ggml type)), and metadata by ``meta(key, value)``."""
    src = GGUFModel(src_path)
    w = gguf.GGUFWriter(str(out), src.arch)
    for key, value in src.meta.items():
        if key != "general.architecture":
            _add(w, src, key, meta(key, value) if meta else value)
    for n, t in src.tensors.items():
        arr = tensor(n, t)
        if isinstance(arr, tuple):
            w.add_tensor(n, arr[0], raw_dtype=arr[1])
        else:
            w.add_tensor(n, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q5_0", "Q5_1"])
def test_other_types_are_dequantized_then_quantized(qtype, hf_models, ggufs, tmp_path):
    """Types coli has no layout for are dequantized (as f32: exactly the GGUF's values) and
    quantized to the closest format by default; near the original checkpoint's logits."""
    ids = prompt_ids(10)
    path = ggufs("llama", qtype)
    deq = _rewrite(path, tmp_path / "deq.gguf", lambda n, t: _dequantized(t))
    exact = coli.load(path, threads=1, quant="f32")
    assert np.array_equal(exact.forward(ids), coli.load(deq, threads=1).forward(ids))
    m = coli.load(path, threads=1)
    fmt = {"F16": "f32", "BF16": "bf16"}.get(qtype, "int8")
    assert (m.weights.quant, m.weights.head_quant) == (fmt, fmt)
    assert np.array_equal(m.forward(ids), coli.load(deq, threads=1, quant=fmt, head_quant=fmt).forward(ids))
    ref = coli.load(hf_models("llama"), threads=1).forward(ids)
    assert np.abs(m.forward(ids) - ref).max() < (1e-2 if qtype == "F16" else 1.0)


# ggml block types gguf cannot quantize in NumPy: (block bytes, offsets of their fp16 scales)
K_BLOCKS = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
            "Q6_K": (210, (208,)), "IQ4_NL": (18, (0,)), "IQ4_XS": (136, (0,)), "IQ3_S": (110, (0,)),
            "IQ3_XXS": (98, (0,)), "IQ2_S": (82, (0,)), "IQ2_XS": (74, (0,)), "IQ2_XXS": (66, (0,)),
            "IQ1_S": (50, (0,))}  # (IQ1_M packs its scale into four nibbles: not drawn here)


def _random_blocks(rows, cols, qtype, rng):
    size, scales = K_BLOCKS[qtype]
    per = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, qtype)][0]
    b = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for off in scales:  # sane scales: 0.002 .. 0.01
        b[..., off:off + 2] = rng.uniform(0.002, 0.01, size=b.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(K_BLOCKS))
def test_k_and_iq_types_are_dequantized_then_quantized(qtype, ggufs, tmp_path):
    """K-quants and IQ types (random blocks of the type, as gguf cannot write them): loaded as
    f32 the model equals the same model written with the dequantized values; by default
    each matrix is coli's closest format of exactly those values."""
    qt = getattr(gguf.GGMLQuantizationType, qtype)

    def blocks(n, t):
        if len(t.shape) == 2 and n != "token_embd.weight":
            return _random_blocks(int(t.shape[1]), int(t.shape[0]), qtype, np.random.default_rng(len(n)))
        return np.asarray(t.data)

    q = _rewrite(ggufs("qwen3-256"), tmp_path / "q.gguf", lambda n, t: (b, qt) if (b := blocks(n, t)).dtype == np.uint8 else b)
    f32 = _rewrite(q, tmp_path / "f32.gguf", lambda n, t: _dequantized(t) if t.tensor_type == qt else np.asarray(t.data))
    ids = prompt_ids(8)
    assert np.array_equal(coli.load(q, threads=1, quant="f32").forward(ids), coli.load(f32, threads=1).forward(ids))
    w = GGUFWeights(GGUFModel(q))
    fmt = "int8" if qtype in ("Q5_K", "Q6_K") else "int4"
    assert w.quant == fmt
    t = GGUFModel(q).tensors["blk.0.ffn_down.weight"]
    m = w.matrix("model.layers.0.mlp.down_proj.weight", int(t.shape[1]), int(t.shape[0]))
    want = quantize(_dequantized(t), fmt)
    assert np.array_equal(m.data, want.data) and np.array_equal(m.scales, want.scales)


def test_split_gguf_loads_from_its_first_part(hf_models, ggufs, tmp_path):
    """A split GGUF (NAME-00001-of-00002.gguf ...): tensors spread over the parts."""
    src = GGUFModel(ggufs("llama"))
    names = list(src.tensors)
    for part, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2:]), start=1):
        w = gguf.GGUFWriter(str(tmp_path / f"m-{part:05d}-of-00002.gguf"), "llama")
        if part == 1:
            for key, value in src.meta.items():
                if key != "general.architecture":
                    _add(w, src, key, value)
        for n in chunk:
            t = src.tensors[n]
            w.add_tensor(n, np.asarray(t.data))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    ids = prompt_ids(8)
    got = coli.load(tmp_path / "m-00001-of-00002.gguf", threads=1).forward(ids)
    assert np.array_equal(got, coli.load(ggufs("llama"), threads=1).forward(ids))
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(ModelLoadError, match="missing m-00002-of-00002.gguf"):
        coli.load(tmp_path / "m-00001-of-00002.gguf")


def _add(w, src, key, value):
    vt = next(f.types[0] for f in gguf.GGUFReader(src.files[0]).fields.values() if f.name == key)
    if vt == gguf.GGUFValueType.ARRAY:
        w.add_array(key, value)
    else:
        w.add_key_value(key, value, vt)


def test_tokenizer_and_template_come_from_the_gguf(ggufs):
    m = coli.load(ggufs("qwen3"), threads=1)
    assert m.tokenizer.decode([5, 17, 3]) == "w5w17w3"  # byte-level BPE: no spaces between words
    assert m.tokenizer.encode("<|end|>") == [m.tokenizer.vocab_size - 1]  # a CONTROL token: special
    assert m.tokenizer.eos_token_ids == {m.tokenizer.vocab_size - 1}
    assert m.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True) \
        == "<user>hi</user><assistant>"


def test_bad_gguf_files_are_one_line_errors(ggufs, tmp_path):
    good = ggufs("llama").read_bytes()
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        coli.load(trunc)
    notg = tmp_path / "x.gguf"
    notg.write_bytes(b"NOPE" + good[4:])
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        coli.load(notg)
    head = tmp_path / "head.gguf"
    head.write_bytes(good[:40])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        coli.load(head)
    w = gguf.GGUFWriter(str(tmp_path / "arch.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"'mamba' is not supported; supported: llama, qwen2"):
        coli.load(tmp_path / "arch.gguf")


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_gguf_moe_converts_and_streams_its_experts(name, ggufs, tmp_path):
    """--ram-budget on a GGUF says to convert it; the converted directory (Q8_0 experts
    repacked as they are) streams within a budget and gives the GGUF's own logits."""
    from coli.weights.convert import convert

    src = ggufs(name, "Q8_0")
    with pytest.raises(ModelLoadError, match="coli convert .* OUT"):
        coli.load(src, ram_budget="1M")
    ids = prompt_ids(10)
    ref = coli.load(src, threads=1).forward(ids)
    out = convert(src, tmp_path / "conv", "int8")
    streamed = coli.load(out, threads=1, ram_budget=1, pin=0)  # the least the store takes: k experts a layer
    assert not streamed.weights.store.resident
    assert np.array_equal(streamed.forward(ids), ref)
    assert streamed.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi</user><assistant>"


def test_a_sentencepiece_vocabulary_gives_the_hugging_face_ids(tmp_path):
    """A Llama-2-style vocabulary (SentencePiece BPE: ▁ prefix, byte fallback, scores = -merge
    rank, CONTROL/UNKNOWN/BYTE token types) written as llama.cpp's `llama` tokenizer model:
    coli's tokenizer rebuilt from it encodes like the original in transformers."""
    import json

    import tokenizers
    from transformers import PreTrainedTokenizerFast

    from coli.weights.gguf_vocab import tokenizer_from_gguf
    from tests.test_tokenizer import CORPUS, _sentencepiece_json

    src = _sentencepiece_json("llama2")
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in json.loads(src)["model"]["merges"]]
    vocab = tokenizers.Tokenizer.from_str(src).get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    rank = {a + b: i for i, (a, b) in enumerate(merges)}
    control = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0 if t in control or t == "<unk>" else -float(rank.get(t, len(merges) + i))
                        for i, t in enumerate(tokens)])
    w.add_token_types([gguf.TokenType.UNKNOWN if t == "<unk>" else gguf.TokenType.CONTROL if t in control
                       else gguf.TokenType.BYTE if t.startswith("<0x") else gguf.TokenType.NORMAL for t in tokens])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_unk_token_id(vocab["<unk>"])
    w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mine = tokenizer_from_gguf(GGUFModel(tmp_path / "spm.gguf"))
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(src), bos_token="<s>", eos_token="</s>")
    texts = [*CORPUS, "Hello world", " two  spaces", "ünïcödé ☃ 🚀", "<|im_start|>user\nhi<|im_end|>", "tabs\tand\nnewlines"]
    for text in texts:
        assert mine.encode(text) == hf.encode(text), text
    assert mine.encode("hi")[0] == vocab["<s>"] and mine.decode(mine.encode("Hello world")[1:]) == "Hello world"


def test_coli_convert_takes_a_gguf_file(ggufs, tmp_path):
    """`coli convert model.gguf OUT` (what loading a GGUF with --ram-budget tells the user to
    run) converts the file; a path that is neither a directory nor a GGUF is one line, exit 2."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
    src = ggufs("qwen3_moe", "Q8_0")
    out = tmp_path / "conv"
    r = subprocess.run([sys.executable, "-m", "coli.cli", "convert", str(src), str(out), "-q", "int8"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    ids = prompt_ids(8)
    assert np.array_equal(coli.load(out, threads=1).forward(ids), coli.load(src, threads=1).forward(ids))
    (tmp_path / "notes.txt").write_text("not a model")
    for bad, says in ((tmp_path / "notes.txt", "neither a directory nor a GGUF file"),
                      (tmp_path / "missing", "no such directory or file")):
        r = subprocess.run([sys.executable, "-m", "coli.cli", "convert", str(bad), str(tmp_path / "x")],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
