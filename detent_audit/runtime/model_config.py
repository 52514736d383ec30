"""`ModelConfig`: the architecture facts of a decoder, read from a Hugging Face config.json.

A `ModelConfig` that exists is valid: `__post_init__` checks every field, and `from_hf_dict` turns a missing
key into `BadCheckpoint` and an architecture or feature the engine does not run into `UnsupportedModel`,
each naming the key. `NAMED_SHAPES` holds the tiny test shapes, the random-20m model and the real
shapes of the shipped deployments (each model's config.json on the Hugging Face Hub).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from detent_audit.manifests.deployment import DTYPE_BYTES, decoder_parameters
from detent_audit.manifests.encoding import JsonValue
from detent_audit.runtime.errors import BadCheckpoint, UnsupportedModel

# architecture -> HF model_type
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
_REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "vocab_size")
# HF's per-architecture defaults for the keys a config.json may leave out.
_MAX_POSITIONS_DEFAULT = {"LlamaForCausalLM": 2048}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency-dependent RoPE scaling (the only `rope_type` the engine runs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise UnsupportedModel(f"rope_scaling type {self.rope_type!r} is not supported (only 'llama3')")
        if not (self.factor > 0 and self.high_freq_factor > self.low_freq_factor > 0):
            raise BadCheckpoint(f"rope_scaling {self.as_dict()} needs factor > 0 and high > low > 0")

    def as_dict(self) -> dict[str, JsonValue]:
        """HF's `rope_scaling` dict (what `RopeCache` and config.json take)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ModelConfig:
    """One decoder's shape. `attention_bias` is the q/k/v bias (always on for Qwen2, whose o_proj has
    none)."""

    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModel(f"architecture {self.architecture!r} is not supported")
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise BadCheckpoint(f"config {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise BadCheckpoint(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                                f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise BadCheckpoint(f"head_dim {self.head_dim} must be even for RoPE")
        if self.torch_dtype not in DTYPE_BYTES:
            raise UnsupportedModel(f"torch_dtype {self.torch_dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.architecture == "Qwen2ForCausalLM" and not self.attention_bias:
            raise BadCheckpoint("Qwen2 always has a q/k/v bias: attention_bias must be True")
        if self.is_moe:
            if not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0):
                raise BadCheckpoint(f"MoE config needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) "
                                    f"<= num_experts ({self.num_experts}) and moe_intermediate_size > 0")
            if self.decoder_sparse_step <= 0:
                raise BadCheckpoint(f"decoder_sparse_step must be positive, got {self.decoder_sparse_step}")
        bad_layers = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad_layers:
            raise BadCheckpoint(f"mlp_only_layers {bad_layers} are not layers of a "
                                f"{self.num_hidden_layers}-layer model")

    # ---- derived -------------------------------------------------------------------------------------------

    @cached_property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture]

    @cached_property
    def is_moe(self) -> bool:
        return self.architecture == "Qwen3MoeForCausalLM"

    @cached_property
    def qk_norm(self) -> bool:
        """Qwen3 normalizes each q and k head (RMSNorm over head_dim) before RoPE."""
        return self.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

    @cached_property
    def o_proj_bias(self) -> bool:
        return self.attention_bias and self.architecture != "Qwen2ForCausalLM"

    def is_moe_layer(self, layer: int) -> bool:
        """HF's rule: a sparse block unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
        return (self.is_moe and self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @cached_property
    def num_parameters(self) -> int:
        return decoder_parameters(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_hidden_layers,
            num_heads=self.num_attention_heads, num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, num_experts=self.num_experts,
            moe_intermediate_size=self.moe_intermediate_size,
            moe_layers=sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers)),
            tied_embeddings=self.tie_word_embeddings, qkv_bias=self.attention_bias, o_bias=self.o_proj_bias,
            qk_norm=self.qk_norm)

    # ---- HF config.json ------------------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Read HF's keys; both the v4 (`rope_theta`, `rope_scaling`) and v5 (`rope_parameters`) forms."""
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModel(f"{source}: architectures {archs} has none of {sorted(ARCHITECTURES)}")

        def need(key: str) -> Any:
            if key not in d:
                raise BadCheckpoint(f"{source} has no {key!r} (needed by {arch})",
                                    remedy=f"add {key!r} to {source}, as the model's publisher has it")
            return d[key]

        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"{source}: hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("mlp_bias", False):
            raise UnsupportedModel(f"{source}: mlp_bias=True is not supported")
        if d.get("use_sliding_window", False):
            raise UnsupportedModel(f"{source}: use_sliding_window=True is not supported")
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        for key in _REQUIRED_KEYS:
            need(key)
        moe = {key: need(key) for key in _MOE_KEYS} if arch == "Qwen3MoeForCausalLM" else {}
        rope: dict[str, Any] = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or rope
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        rope_scaling = None
        if rope_type not in ("default", "llama3"):
            raise UnsupportedModel(f"{source}: rope scaling type {rope_type!r} is not supported (only "
                                   "'llama3')")
        if rope_type == "llama3":
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            missing = [k for k in keys if k not in scaling]
            if missing:
                raise BadCheckpoint(f"{source}: llama3 rope scaling has no {missing}")
            rope_scaling = RopeScaling(**{k: scaling[k] for k in keys})
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else tuple(sorted(eos)) if isinstance(eos, list) else (int(eos),)
        return cls(
            architecture=arch, hidden_size=hidden, num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads, intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            max_position_embeddings=d.get("max_position_embeddings", _MAX_POSITIONS_DEFAULT.get(arch, 32768)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "Qwen2ForCausalLM" else bool(d.get("attention_bias", False)),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=d.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(sorted(d.get("mlp_only_layers") or ())), bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids, torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
            **moe,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `path/config.json`; a missing or unparsable file is `BadCheckpoint`."""
        file = Path(path) / "config.json"
        try:
            d = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise BadCheckpoint(f"cannot read {file}: {exc}") from exc
        return cls.from_hf_dict(d, source=str(file))

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        if name not in NAMED_SHAPES:
            raise UnsupportedModel(f"no model shape named {name!r}",
                                   remedy=f"use one of {sorted(NAMED_SHAPES)}")
        return NAMED_SHAPES[name]

    def to_hf_dict(self) -> dict[str, JsonValue]:
        """config.json with HF's key names (v4 form, which transformers 4.x and 5.x both read)."""
        ids = self.eos_token_ids
        eos: JsonValue = list(ids) if len(ids) != 1 else ids[0]
        d: dict[str, JsonValue] = {
            "architectures": [self.architecture], "model_type": self.model_type, "hidden_act": "silu",
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.as_dict() if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": eos, "torch_dtype": self.torch_dtype, "use_cache": True,
        }
        if self.architecture != "Qwen2ForCausalLM":
            d["attention_bias"] = self.attention_bias
        if self.architecture != "LlamaForCausalLM":
            d["use_sliding_window"] = False
        if self.is_moe:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers))
        return d


def served_context(asked: int | None, positions: int, pool_tokens: int | None = None) -> int:
    """The context an engine serves (prompt plus output tokens), one rule for every engine: the one asked
    (`--max-model-len`) within the model's `positions`; none asked, the model's own, within the tokens the
    engine's KV pool holds (`pool_tokens`, None: not bounded by the engine)."""
    if asked is not None:
        return min(asked, positions)
    return positions if pool_tokens is None else max(2, min(positions, pool_tokens))


def _shape(architecture: str, **kw: Any) -> ModelConfig:
    kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    return ModelConfig(architecture=architecture, **kw)


_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, vocab_size=320, max_position_embeddings=4096, torch_dtype="float32")
_LLAMA3_TOKENS = dict(bos_token_id=256, eos_token_ids=(257, 260))     # checkpoint.LLAMA3_SPECIALS
_CHATML_TOKENS = dict(bos_token_id=None, eos_token_ids=(256, 258))    # checkpoint.CHATML_SPECIALS

NAMED_SHAPES: dict[str, ModelConfig] = {
    # tiny shapes for tests: every feature of the family on, seconds on a CPU
    # (theta 1e4 and an original context of 64 put head_dim 16's wavelengths in all three llama3 bands)
    "tiny-llama": _shape("LlamaForCausalLM", **_TINY, **_LLAMA3_TOKENS, rms_norm_eps=1e-5, rope_theta=10000.0,
                         rope_scaling=RopeScaling(4.0, 1.0, 4.0, 64)),
    "tiny-qwen2": _shape("Qwen2ForCausalLM", **_TINY, **_CHATML_TOKENS, attention_bias=True,
                         rope_theta=1000000.0),
    "tiny-qwen3": _shape("Qwen3ForCausalLM", **_TINY, **_CHATML_TOKENS, rope_theta=1000000.0),
    "tiny-qwen3-moe": _shape("Qwen3MoeForCausalLM", **{**_TINY, "num_hidden_layers": 3}, **_CHATML_TOKENS,
                             rope_theta=1000000.0, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=(0,)),
    # the random-20m model (checkpoint.ensure_default_model): ~19.4M parameters, Llama-shaped
    "default-20m": _shape("LlamaForCausalLM", hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                          num_key_value_heads=4, intermediate_size=1536, vocab_size=512,
                          max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                          torch_dtype="float32", **_LLAMA3_TOKENS),
    # real shapes (each model's config.json) for GPU runs and deployment facts
    "llama-3.2-1b": _shape("LlamaForCausalLM", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                           max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                           rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), tie_word_embeddings=True,
                           bos_token_id=128000, eos_token_ids=(128001,)),
    "llama-3.1-8b": _shape("LlamaForCausalLM", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                           max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                           rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), bos_token_id=128000,
                           eos_token_ids=(128001,)),
    "qwen3-30b-a3b": _shape("Qwen3MoeForCausalLM", hidden_size=2048, num_hidden_layers=48,
                            num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960,
                            rms_norm_eps=1e-6, rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=768, norm_topk_prob=True, bos_token_id=151643,
                            eos_token_ids=(151645,)),
}
