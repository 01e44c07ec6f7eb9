"""Model configuration, parsed once from config.json into frozen dataclasses.

Field names are the checkpoint's own (``num_key_value_heads``,
``num_experts_per_tok``, ...). Both spellings transformers has used are read:
``rope_theta`` + ``rope_scaling`` (4.x) and ``rope_parameters`` (5.x), and
``num_experts`` / ``num_local_experts``.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coli.errors import ModelLoadError

SWITCH_ON, SWITCH_OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_switch(name: str, env=None, default: bool = True) -> bool:
    """An on/off environment variable (1/true/yes/on, 0/false/no/off; unset: ``default``);
    InvalidRequestError, whose message is one line for the CLI, for any other value."""
    raw = (os.environ if env is None else env).get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v not in SWITCH_ON + SWITCH_OFF:
        from coli.errors import InvalidRequestError

        raise InvalidRequestError(f"{name}={raw!r} must be 1 (on{', the default' if default else ''}) or 0 "
                                  f"(off{', the default' if not default else ''})")
    return v in SWITCH_ON


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | yarn | dynamic
    params: dict = field(default_factory=dict)

    def inv_freq(self, rot_dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
        """(inv_freq float32 (rot_dim/2,), attention scaling), as transformers' rope init computes them."""
        base = np.float32(self.theta)
        exps = np.arange(0, rot_dim, 2, dtype=np.float32) / np.float32(rot_dim)  # (rot_dim/2,)
        pos_freqs = (base ** exps).astype(np.float32)
        inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
        p, scaling = self.params, 1.0
        if self.rope_type in ("default", "dynamic"):
            # dynamic NTK only changes past max_position_embeddings; we refuse longer contexts
            if "freq_factors" in p:  # a GGUF's rope_freqs tensor (llama.cpp's form of Llama 3.1 scaling)
                inv = (inv / np.asarray(p["freq_factors"], dtype=np.float32)).astype(np.float32)
        elif self.rope_type == "linear":
            inv = (inv / np.float32(p["factor"])).astype(np.float32)
        elif self.rope_type == "llama3":
            factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
            old = p["original_max_position_embeddings"]
            lo_wl, hi_wl = old / lo, old / hi
            wavelen = (2 * math.pi / inv).astype(np.float32)
            scaled = np.where(wavelen > lo_wl, inv / factor, inv).astype(np.float32)
            smooth = ((old / wavelen - lo) / (hi - lo)).astype(np.float32)
            smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
            medium = ~(wavelen < hi_wl) & ~(wavelen > lo_wl)
            inv = np.where(medium, smoothed, scaled).astype(np.float32)
        elif self.rope_type == "yarn":
            inv, scaling = self._yarn(rot_dim, pos_freqs, max_position_embeddings)
        else:
            raise ModelLoadError(f"config.json: rope type {self.rope_type!r} is not supported "
                                 "(supported: default, linear, llama3, yarn, dynamic)")
        return inv, float(scaling)

    def _yarn(self, dim, pos_freqs, max_pos):
        p = self.params
        factor = p.get("factor")
        orig = p.get("original_max_position_embeddings") or max_pos
        if factor is None:
            factor = max_pos / orig

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = p.get("attention_factor")
        if attn is None:
            if p.get("mscale") and p.get("mscale_all_dim"):
                attn = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
            else:
                attn = mscale(factor)
        beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

        def corr_dim(rot):
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        extra = (1 - ramp).astype(np.float32)
        inv_extra = (np.float32(1.0) / pos_freqs).astype(np.float32)
        inv_inter = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
        return (inv_inter * (1 - extra) + inv_extra * extra).astype(np.float32), attn


LAYER_TYPES = ("full_attention", "sliding_attention")


def _rope_one(raw: dict, params: dict, theta_default=None) -> RopeConfig:
    params = dict(params)
    params.pop("partial_rotary_factor", None)
    theta = params.pop("rope_theta", None) or theta_default or raw.get("rope_theta") or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type in ("llama3", "yarn", "longrope") and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = raw.get(
            "original_max_position_embeddings", raw.get("max_position_embeddings", 2048))
    return RopeConfig(theta=float(theta), rope_type=rope_type, params=params)


def _rope_from(raw: dict) -> tuple[RopeConfig, dict[str, RopeConfig]]:
    """The default RoPE, and per attention type where the config gives them (Gemma 3:
    local layers with their own base; transformers 5 nests rope_parameters by type,
    4.x used rope_local_base_freq)."""
    rp = raw.get("rope_parameters")
    if isinstance(rp, dict) and any(isinstance(rp.get(t), dict) for t in LAYER_TYPES):
        by_type = {t: _rope_one(raw, rp[t]) for t in LAYER_TYPES if isinstance(rp.get(t), dict)}
        return by_type.get("full_attention") or next(iter(by_type.values())), by_type
    if isinstance(rp, dict) and ("rope_type" in rp or "rope_theta" in rp or "type" in rp):
        default = _rope_one(raw, rp)
    else:
        default = _rope_one(raw, raw.get("rope_scaling") or {})
    by_type = {"full_attention": default}
    if raw.get("rope_local_base_freq"):
        by_type["sliding_attention"] = RopeConfig(theta=float(raw["rope_local_base_freq"]))
    return default, by_type


def _partial_rotary(raw: dict) -> float:
    rp = raw.get("rope_parameters")
    if isinstance(rp, dict) and rp.get("partial_rotary_factor"):
        return float(rp["partial_rotary_factor"])
    return float(raw.get("partial_rotary_factor") or 1.0)


def _layer_types(raw: dict, n_layers: int) -> tuple[str, ...]:
    """Each layer's attention type: config.layer_types, else Gemma's sliding_window_pattern
    (every Nth layer global), else all full attention."""
    lt = raw.get("layer_types")
    if isinstance(lt, list) and len(lt) == n_layers:
        return tuple(lt)
    pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
    if pattern and raw.get("sliding_window"):
        return tuple("full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention" for i in range(n_layers))
    return ("full_attention",) * n_layers


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope: RopeConfig
    rope_by_layer_type: dict = field(default_factory=dict, repr=False, compare=False)
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    partial_rotary_factor: float = 1.0
    hidden_act: str = "silu"
    # mixture of experts (0 experts: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    eos_token_id: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    def rope_for(self, layer: int) -> RopeConfig:
        """The RoPE of layer ``layer`` (its attention type's, else the default)."""
        t = self.layer_types[layer] if layer < len(self.layer_types) else "full_attention"
        return self.rope_by_layer_type.get(t, self.rope)

    def window_for(self, layer: int) -> int:
        """Sliding-window size of layer ``layer`` (0: attends the whole context)."""
        t = self.layer_types[layer] if layer < len(self.layer_types) else "full_attention"
        return self.sliding_window if t == "sliding_attention" else 0

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        def need(key, *alts):
            for k in (key, *alts):
                if raw.get(k) is not None:
                    return raw[k]
            raise ModelLoadError(f"{source}: missing required field {key!r}")

        try:
            hidden = int(need("hidden_size"))
            heads = int(need("num_attention_heads"))
            eos = raw.get("eos_token_id")
            eos = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
            experts = int(raw.get("num_experts") or raw.get("num_local_experts") or raw.get("n_routed_experts") or 0)
            n_layers = int(need("num_hidden_layers"))
            rope, rope_by_type = _rope_from(raw)
            return cls(
                model_type=str(need("model_type")),
                hidden_size=hidden,
                num_hidden_layers=n_layers,
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                vocab_size=int(need("vocab_size")),
                intermediate_size=int(raw.get("intermediate_size") or 0),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                rope=rope,
                rope_by_layer_type=rope_by_type,
                layer_types=_layer_types(raw, n_layers),
                sliding_window=int(raw.get("sliding_window") or 0),
                partial_rotary_factor=_partial_rotary(raw),
                hidden_act=str(raw.get("hidden_act") or raw.get("hidden_activation") or "silu"),
                num_experts=experts,
                num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(raw.get("moe_intermediate_size") or raw.get("intermediate_size") or 0),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
                eos_token_id=eos,
                raw=raw,
            )
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: invalid value ({e})") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ModelLoadError(f"{model_dir}: not a directory (pass a Hugging Face model directory)")
        if not path.exists():
            raise ModelLoadError(f"{path}: missing (a model directory needs config.json)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: not a JSON object")
        return cls.from_dict(raw, str(path))
