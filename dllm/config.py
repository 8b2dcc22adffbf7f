"""SDARConfig: the Hugging Face `config.json` of SDAR / TraDo block-diffusion models.

    cfg = load_model_config("/models/SDAR-1.7B-Chat")                    # folder as published
    cfg = load_model_config(folder, block_size=4)                         # folder lacking block_size
    cfg = SDARConfig.from_json_file("path/to/config.json")
    cfg.save("runs/out")  # writes config.json with model_type "sdar"

Fields follow SDAR checkpoints (a Qwen3 config plus `block_size` and `mask_token_id`).
Every other field of a public config.json is either understood or knowingly ignored:
`IGNORED_FIELDS` (kernels, parallelism, bookkeeping: they do not change the maths) are
kept in `extra` and written back unchanged; fields that would change the maths and that
dlrl does not implement (a rope scaling type other than default, sliding-window
attention, mixture of experts, quantized weights, an activation other than SiLU) stop
with a `ConfigValueError` naming the field; fields nobody listed are kept and logged.

A folder without `block_size` / `mask_token_id` loads when they are given explicitly
(options) or, for the mask, when the tokenizer has a `<|MASK|>` token; the log says which.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

SUPPORTED_MODEL_TYPES = ("sdar", "trado", "qwen3")
MASK_TOKEN = "<|MASK|>"
log = logging.getLogger("dlrl.model")

# fields of public SDAR / TraDo / Qwen3 configs that do not change what dlrl computes
IGNORED_FIELDS = {
    "architectures": "class names for transformers",
    "auto_map": "custom-code entry points for transformers (kept for exports)",
    "transformers_version": "bookkeeping",
    "attn_implementation": "attention kernel choice (dlrl picks SDPA on CPU, FlexAttention on CUDA)",
    "_attn_implementation": "attention kernel choice",
    "fuse_cross_entropy": "training kernel choice (same loss)",
    "micro_forward": "training kernel choice",
    "skip_checkpoint": "activation checkpointing choice",
    "use_cache": "generation-time switch of transformers",
    "debug": "bookkeeping",
    "ep_size": "expert parallelism (dense models: 1)",
    "use_deepep": "expert-parallel communication kernel",
    "initializer_range": "initialisation only",
    "max_window_layers": "only used with sliding-window attention (refused below when on)",
    "sliding_window": "checked: must be off (use_sliding_window false or null)",
    "use_sliding_window": "checked: must be false",
    "rope_scaling": "checked: null or the default rope type",
    "rope_parameters": "read: rope_theta and rope_type (transformers >= 4.57 layout)",
    "hidden_act": "checked: must be silu",
    "attention_dropout": "dropout is off in dlrl (RL recipes train without it); a value > 0 is logged",
    "layer_types": "checked: every layer must be full attention",
    "dtype": "storage dtype (transformers >= 4.56 name of torch_dtype)",
    "_name_or_path": "bookkeeping",
    "name_or_path": "bookkeeping",
    "output_attentions": "transformers output switch",
    "output_hidden_states": "transformers output switch",
    "return_dict": "transformers output switch",
    "generation_config": "generation defaults (eos ids are read from generation_config.json)",
}
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class ConfigValueError(ValueError):
    """A model config is unusable; the message names the field."""


def eos_list(eos_token_id: int | list[int] | None) -> list[int]:
    """config.json's eos_token_id (one id, a list or null) as a list."""
    if eos_token_id is None:
        return []
    return [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)


@dataclass
class ModelConfig(abc.ABC):
    """The fields (Qwen-style names) and checks every model family's config shares: SDARConfig here,
    dllm.full.config.FullAttentionConfig (LLaDA, Dream). Defaults: SDAR-1.7B's."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int = 32768
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    block_size: int = 4
    mask_token_id: int = 151669
    eos_token_id: int | list[int] | None = 151643
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    model_type: str = "sdar"

    SIZES: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                        "num_attention_heads", "num_key_value_heads", "head_dim", "block_size")

    def validate(self) -> None:
        """The checks every family shares (ConfigValueError naming the field): SIZES are positive integers,
        num_key_value_heads divides num_attention_heads, mask_token_id is in the vocabulary."""
        for name in self.SIZES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigValueError(f"{name}: must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigValueError("num_key_value_heads: must divide num_attention_heads "
                                   f"({self.num_attention_heads} % {self.num_key_value_heads} != 0)")
        mask = self.mask_token_id
        if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < self.vocab_size:
            raise ConfigValueError(f"mask_token_id: {mask} is outside the vocabulary (vocab_size={self.vocab_size})")

    @property
    def eos_ids(self) -> list[int]:
        return eos_list(self.eos_token_id)

    @classmethod
    @abc.abstractmethod
    def from_dict(cls, d: dict[str, Any], *, block_size: int | None = None,
                  mask_token_id: int | None = None) -> Self:
        """Parse a config.json dict (ConfigValueError naming the field); the options win over the file."""

    @classmethod
    def from_json_file(cls, path: str | Path, **options: Any) -> Self:
        return cls.from_dict(read_config_json(path), **options)

    @abc.abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """The config.json dict."""

    def save(self, directory: str | Path) -> None:
        """Write `directory/config.json` (`to_dict()`)."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


@dataclass
class SDARConfig(ModelConfig):
    extra: dict[str, Any] = field(default_factory=dict)

    attention: ClassVar[str] = "block_causal"  # dllm.full.config.FullAttentionConfig's is "full"
    family: ClassVar[str] = "sdar"

    def validate(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigValueError(
                f"model_type: unsupported {self.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        super().validate()
        if self.max_position_embeddings % self.block_size:
            raise ConfigValueError(f"block_size: {self.block_size} must divide max_position_embeddings "
                                   f"({self.max_position_embeddings})")

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, block_size: int | None = None,
                  mask_token_id: int | None = None) -> Self:
        """Parse a config.json dict. `block_size` / `mask_token_id` given here win over the
        file's; where neither has them, a ConfigValueError names the missing field."""
        if "model_type" not in d:
            raise ConfigValueError("model_type: missing from config.json")
        if d["model_type"] not in SUPPORTED_MODEL_TYPES:
            raise ConfigValueError(f"model_type: unsupported {d['model_type']!r} "
                                   f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        for name in REQUIRED_FIELDS:
            if d.get(name) is None:
                raise ConfigValueError(f"{name}: missing from config.json")
        check_maths_fields(d)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names and v is not None}
        extra = {k: v for k, v in d.items() if k not in names}
        unknown = sorted(k for k in extra if k not in IGNORED_FIELDS)
        if unknown:
            log.warning("config.json: fields dlrl does not know, kept but not used: %s", ", ".join(unknown))
        known.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
        known.setdefault("num_key_value_heads", d["num_attention_heads"])
        # transformers' Qwen3Config defaults for the optional fields
        known.setdefault("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        known.setdefault("max_position_embeddings", 32768)
        known.setdefault("torch_dtype", d.get("dtype") or "float32")
        known["rope_theta"] = float(known["rope_theta"])
        for name, given in (("block_size", block_size), ("mask_token_id", mask_token_id)):
            if given is not None:
                if name in known and known[name] != given:
                    log.info("%s: using %s from the options instead of %s in config.json", name, given, known[name])
                known[name] = given
            elif name not in known:
                raise ConfigValueError(f"{name}: missing from config.json; give it explicitly "
                                       f"(e.g. server.{name}=... / load_pretrained(..., {name}=...))")
        known.setdefault("eos_token_id", None)
        cfg = cls(**known, extra=extra)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "extra"}
        d.update(self.extra)
        d.setdefault("architectures", ["SDARForCausalLM"])
        return d


def check_maths_fields(d: dict[str, Any]) -> None:
    """Refuse configs whose maths dlrl does not implement; the error names the field."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigValueError(f"hidden_act: {act!r} is not implemented (SDAR/Qwen3 use 'silu')")
    for name in ("rope_scaling", "rope_parameters"):
        rope = d.get(name)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ConfigValueError(f"{name}: expected an object or null, got {rope!r}")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ConfigValueError(f"{name}: rope type {kind!r} is not implemented (only the default "
                                   "rotary embedding; remove the scaling or use a model without it)")
    if d.get("use_sliding_window") or ("use_sliding_window" not in d and d.get("sliding_window")):
        field_name = "use_sliding_window" if d.get("use_sliding_window") else "sliding_window"
        raise ConfigValueError(f"{field_name}: sliding-window attention is not implemented "
                               "(SDAR checkpoints ship it off)")
    sliding = [t for t in d.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        raise ConfigValueError(f"layer_types: only full-attention layers are implemented, got {sliding[0]!r}")
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if d.get(name):
            raise ConfigValueError(f"{name}: mixture-of-experts checkpoints are not implemented "
                                   "(dense SDAR / TraDo only)")
    if d.get("quantization_config"):
        raise ConfigValueError("quantization_config: quantized checkpoints are not supported (use bf16/fp32 weights)")
    if d.get("attention_dropout"):
        log.warning("attention_dropout: %s ignored (dlrl trains and decodes without dropout)",
                    d["attention_dropout"])


def read_config_json(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"config.json not found: {p}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigValueError(f"{p} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigValueError(f"{p}: expected a JSON object")
    return data


def load_model_config(folder: str | Path, block_size: int | None = None,
                      mask_token_id: int | None = None) -> SDARConfig:
    """The SDARConfig of a model folder as published. Missing `block_size` / `mask_token_id`
    come from the arguments; a missing mask id also from the tokenizer's `<|MASK|>` token.
    Where a value comes from is logged."""
    from dllm.tokenizer import find_token_id

    folder = Path(folder)
    data = read_config_json(folder)
    if block_size is not None and "block_size" not in data:
        log.info("block_size: %s lacks it; using %d from the options", folder / "config.json", block_size)
    if mask_token_id is None and data.get("mask_token_id") is None:
        mask_token_id = find_token_id(folder, MASK_TOKEN)
        if mask_token_id is not None:
            log.info("mask_token_id: %s lacks it; using %d, the id of %s in the tokenizer",
                     folder / "config.json", mask_token_id, MASK_TOKEN)
    elif mask_token_id is not None and "mask_token_id" not in data:
        log.info("mask_token_id: %s lacks it; using %d from the options", folder / "config.json", mask_token_id)
    return SDARConfig.from_dict(data, block_size=block_size, mask_token_id=mask_token_id)
