"""FullAttentionConfig: the config.json of full-attention diffusion LMs (LLaDA, Dream), and family detection.

    family = detect_family(read_config_json(folder))      # "sdar" | "llada" | "dream" (no code runs)
    cfg = load_full_config(folder, block_size=32)          # a LLaDA or Dream folder as published
    cfg.to_dict()                                          # the official config.json back (auto_map kept)

The family comes from `model_type`, else `architectures`, else the module names of `auto_map`
(`modeling_llada` / `modeling_dream`): nothing from the folder is imported or executed (dllm/family.py,
torch-free; re-exported here). LLaDA configs
use OLMo field names (`d_model`, `n_heads`, `n_kv_heads`, `n_layers`, `mlp_hidden_size`,
`embedding_size`, `weight_tying`, `max_sequence_length`, ...), Dream configs Qwen2's. Both are read into
one dataclass with Qwen-style names; the folder's dict is kept verbatim in `raw` and written back with
only the fields dlrl changed (`torch_dtype`, and `block_size` / `mask_token_id` where it lacked them).
Fields that would change the maths and that dlrl does not implement (ALiBi, LayerNorm instead of
RMSNorm, QK layer norm, biases outside q/k/v, logit scaling, input embedding scaling, a sequential
OLMo block, rope scaling, sliding windows) stop with a `ConfigValueError` naming the field.

`block_size` is the decoding block (the reference's `block_length`, 32 by default); the official
configs have none: it comes from the options, else the config's own field, else 32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

from dllm.config import ConfigValueError, ModelConfig, check_maths_fields, read_config_json
from dllm.family import FULL_FAMILIES, SDAR_TYPES, Family, detect_family, folder_family  # noqa: F401  (re-exported)

DEFAULT_BLOCK_SIZE = 32  # the reference rollouts' block_length
LLADA_MASK_ID, LLADA_EOS_ID = 126336, 126081
DREAM_MASK_ID, DREAM_PAD_ID, DREAM_EOS_ID = 151666, 151643, 151645  # <|mask|>, <|endoftext|>, <|im_end|>


@dataclass
class FullAttentionConfig(ModelConfig):
    """One config for both full-attention families (ModelConfig's fields, `vocab_size` the logits width: LLaDA's
    embedding_size, the padded vocabulary; `attention_bias`: q/k/v biases, Dream's always; `raw` is the
    folder's dict). Defaults: ModelConfig's sizes with LLaDA's ids."""

    block_size: int = DEFAULT_BLOCK_SIZE
    mask_token_id: int = LLADA_MASK_ID
    eos_token_id: int | list[int] | None = LLADA_EOS_ID
    pad_token_id: int | None = LLADA_EOS_ID
    model_type: str = "llada"
    family: str = "llada"
    rope_full_precision: bool = True  # LLaDA: rope in fp32; Dream (Qwen2): in the model dtype
    raw: dict[str, Any] = field(default_factory=dict)

    attention: ClassVar[str] = "full"  # SDARConfig's is "block_causal"
    SIZES: ClassVar[tuple[str, ...]] = (*ModelConfig.SIZES, "max_position_embeddings")

    @property
    def logit_shift(self) -> int:
        """1 where position i's logits come from the hidden state at i - 1 (Dream), else 0 (LLaDA)."""
        return 1 if self.family == "dream" else 0

    def validate(self) -> None:
        if self.family not in FULL_FAMILIES:
            raise ConfigValueError(f"model_type: {self.family!r} is not a full-attention family ({FULL_FAMILIES})")
        super().validate()
        if self.head_dim % 2:
            raise ConfigValueError(f"head_dim: rotary embeddings need an even head size, got {self.head_dim}")
        for i in self.eos_ids + ([self.pad_token_id] if self.pad_token_id is not None else []):
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise ConfigValueError(f"eos_token_id: {i!r} is outside the vocabulary (vocab_size={self.vocab_size})")

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, block_size: int | None = None,
                  mask_token_id: int | None = None) -> Self:
        """Parse a LLaDA or Dream config.json dict (ConfigValueError naming the field)."""
        family = detect_family(d)
        if family == "sdar":
            raise ConfigValueError(f"model_type: {d.get('model_type')!r} is block-causal SDAR: use dllm.config")
        fields = _llada_fields(d) if family == "llada" else _dream_fields(d)
        fields["block_size"] = block_size if block_size is not None else int(d.get("block_size") or DEFAULT_BLOCK_SIZE)
        if mask_token_id is not None:
            fields["mask_token_id"] = mask_token_id
        cfg = cls(family=family, model_type=str(d.get("model_type", family)), raw=dict(d), **fields)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The official config.json: the folder's own fields (built from this config when there is no
        folder dict), `torch_dtype` following the config, `block_size` / `mask_token_id` added if absent."""
        d = dict(self.raw) if self.raw else self._official()
        d["torch_dtype"] = self.torch_dtype
        if "dtype" in d:
            d["dtype"] = self.torch_dtype
        d.setdefault("mask_token_id", self.mask_token_id)
        d.setdefault("block_size", self.block_size)
        return d

    def _official(self) -> dict[str, Any]:
        return official_llada_config(self) if self.family == "llada" else official_dream_config(self)


def _int(d: dict[str, Any], name: str, default: Any = None) -> int:
    v = d.get(name)
    v = default if v is None else v
    if v is None:
        raise ConfigValueError(f"{name}: missing from config.json")
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigValueError(f"{name}: must be an integer, got {v!r}")
    return v


def _llada_fields(d: dict[str, Any]) -> dict[str, Any]:
    """LLaDA (OLMo names) -> FullAttentionConfig fields; refuses what modeling_llada.py would do differently."""
    refuse = {"alibi": "ALiBi", "attention_layer_norm": "QK layer norm", "include_bias": "biases in every linear",
              "bias_for_layer_norm": "layer norm biases", "scale_logits": "logit scaling",
              "input_emb_norm": "input embedding scaling", "clip_qkv": "q/k/v clipping"}
    for name, what in refuse.items():
        if d.get(name):
            raise ConfigValueError(f"{name}: {what} is not implemented (LLaDA checkpoints ship it off)")
    checks = {"block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu"}
    for name, want in checks.items():
        if str(d.get(name, want)).lower() != want:
            raise ConfigValueError(f"{name}: {d.get(name)!r} is not implemented (LLaDA uses {want!r})")
    if d.get("rope") is False:
        raise ConfigValueError("rope: learned absolute positions are not implemented (LLaDA uses rope: true)")
    if d.get("layer_norm_with_affine") is False:
        raise ConfigValueError("layer_norm_with_affine: norms without weights are not implemented")
    if d.get("block_group_size", 1) != 1:
        raise ConfigValueError(f"block_group_size: {d.get('block_group_size')} is not implemented (LLaDA uses 1)")
    hidden, heads = _int(d, "d_model"), _int(d, "n_heads")
    if hidden % heads:
        raise ConfigValueError(f"n_heads: must divide d_model ({hidden} % {heads} != 0)")
    kv = d.get("n_kv_heads")
    if d.get("multi_query_attention"):
        kv = 1
    vocab = _int(d, "vocab_size")
    emb = d.get("embedding_size") or vocab
    if emb < vocab:
        raise ConfigValueError(f"embedding_size: {emb} is smaller than vocab_size {vocab}")
    mlp = d.get("mlp_hidden_size") or _int(d, "mlp_ratio", 4) * hidden
    eos = d.get("eos_token_id", LLADA_EOS_ID)
    return dict(vocab_size=int(emb), hidden_size=hidden, intermediate_size=int(mlp),
                num_hidden_layers=_int(d, "n_layers"), num_attention_heads=heads,
                num_key_value_heads=int(kv) if kv else heads, head_dim=hidden // heads,
                max_position_embeddings=int(d.get("max_sequence_length") or 4096),
                rope_theta=float(d.get("rope_theta", 10000.0)), rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(d.get("weight_tying", True)),
                attention_bias=bool(d.get("include_qkv_bias")),
                rope_full_precision=bool(d.get("rope_full_precision", True)),
                mask_token_id=_int(d, "mask_token_id", LLADA_MASK_ID),
                eos_token_id=eos, pad_token_id=d.get("pad_token_id", eos), bos_token_id=d.get("bos_token_id"),
                torch_dtype=_dtype_of(d))


def _dream_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Dream (Qwen2 names, q/k/v biases, no q/k norms) -> FullAttentionConfig fields."""
    check_maths_fields(d)  # silu, default rope, no sliding window, no MoE, no quantization
    hidden, heads = _int(d, "hidden_size"), _int(d, "num_attention_heads")
    if hidden % heads:
        raise ConfigValueError(f"num_attention_heads: must divide hidden_size ({hidden} % {heads} != 0)")
    return dict(vocab_size=_int(d, "vocab_size"), hidden_size=hidden, intermediate_size=_int(d, "intermediate_size"),
                num_hidden_layers=_int(d, "num_hidden_layers"), num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads), head_dim=hidden // heads,
                max_position_embeddings=int(d.get("max_position_embeddings") or 32768),
                rope_theta=float(d.get("rope_theta", 10000.0)), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), attention_bias=True,
                rope_full_precision=False,
                mask_token_id=_int(d, "mask_token_id", DREAM_MASK_ID),
                eos_token_id=d.get("eos_token_id", DREAM_PAD_ID), pad_token_id=d.get("pad_token_id", DREAM_PAD_ID),
                bos_token_id=d.get("bos_token_id"), torch_dtype=_dtype_of(d))


def _dtype_of(d: dict[str, Any]) -> str:
    return str(d.get("torch_dtype") or d.get("dtype") or "float32")


def official_llada_config(c: FullAttentionConfig) -> dict[str, Any]:
    """config.json of GSAI-ML/LLaDA-8B-Instruct's layout with `c`'s values (every field it ships)."""
    return {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                     "AutoModel": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": c.hidden_size,
        "embedding_dropout": 0.0, "embedding_size": c.vocab_size, "eos_token_id": c.eos_token_id,
        "flash_attention": False, "include_bias": False, "include_qkv_bias": c.attention_bias,
        "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02,
        "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
        "mask_token_id": c.mask_token_id, "max_sequence_length": c.max_position_embeddings,
        "mlp_hidden_size": c.intermediate_size, "mlp_ratio": 4, "model_type": "llada",
        "multi_query_attention": None, "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads,
        "n_layers": c.num_hidden_layers, "pad_token_id": c.pad_token_id, "precision": "amp_bf16",
        "residual_dropout": 0.0, "rms_norm_eps": c.rms_norm_eps, "rope": True,
        "rope_full_precision": c.rope_full_precision, "rope_theta": c.rope_theta, "scale_logits": False,
        "transformers_version": "4.46.3", "use_cache": False, "vocab_size": c.vocab_size,
        "weight_tying": c.tie_word_embeddings, "torch_dtype": c.torch_dtype,
    }


def official_dream_config(c: FullAttentionConfig) -> dict[str, Any]:
    """config.json of Dream-org/Dream-v0-Instruct-7B's layout with `c`'s values."""
    return {
        "architectures": ["DreamModel"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "hidden_act": "silu",
        "hidden_size": c.hidden_size, "initializer_range": 0.02, "intermediate_size": c.intermediate_size,
        "mask_token_id": c.mask_token_id, "max_position_embeddings": c.max_position_embeddings,
        "max_window_layers": c.num_hidden_layers, "model_type": "Dream",
        "num_attention_heads": c.num_attention_heads, "num_hidden_layers": c.num_hidden_layers,
        "num_key_value_heads": c.num_key_value_heads, "pad_token_id": c.pad_token_id,
        "rms_norm_eps": c.rms_norm_eps, "rope_scaling": None, "rope_theta": c.rope_theta, "sliding_window": None,
        "tie_word_embeddings": c.tie_word_embeddings, "torch_dtype": c.torch_dtype,
        "transformers_version": "4.46.2", "use_cache": False, "use_sliding_window": False,
        "vocab_size": c.vocab_size,
    }


def load_full_config(folder: str | Path, block_size: int | None = None,
                     mask_token_id: int | None = None) -> FullAttentionConfig:
    """The FullAttentionConfig of a LLaDA or Dream folder (config.json as published)."""
    return FullAttentionConfig.from_dict(read_config_json(folder), block_size=block_size, mask_token_id=mask_token_id)
