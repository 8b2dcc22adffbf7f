"""SDARConfig: the Hugging Face `config.json` of SDAR / TraDo block-diffusion models.

    cfg = SDARConfig.from_json_file("path/to/model/config.json")
    cfg.save("runs/out")  # writes config.json with model_type "sdar"

Fields follow SDAR checkpoints (a Qwen3 config plus `block_size` and `mask_token_id`).
Unknown keys in the JSON are kept in `extra` and written back unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("sdar", "trado", "qwen3")


class ConfigValueError(ValueError):
    """A model config is unusable; the message names the field."""


@dataclass
class SDARConfig:
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
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigValueError(
                f"model_type: unsupported {self.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigValueError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.max_position_embeddings % self.block_size:
            raise ConfigValueError(f"block_size: {self.block_size} must divide max_position_embeddings "
                                   f"({self.max_position_embeddings})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigValueError("num_key_value_heads: must divide num_attention_heads "
                                   f"({self.num_attention_heads} % {self.num_key_value_heads} != 0)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigValueError(f"mask_token_id: {self.mask_token_id} is outside the vocabulary "
                                   f"(vocab_size={self.vocab_size})")

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SDARConfig:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        if "model_type" not in d:
            raise ConfigValueError("model_type: missing from config.json")
        if known.get("head_dim") is None:
            known["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if known.get("num_key_value_heads") is None:
            known["num_key_value_heads"] = d.get("num_attention_heads", cls.num_attention_heads)
        cfg = cls(**known, extra=extra)
        cfg.validate()
        return cfg

    @classmethod
    def from_json_file(cls, path: str | Path) -> SDARConfig:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"config.json not found: {p}")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigValueError(f"{p} is not valid JSON: {e}") from e
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "extra"}
        d.update(self.extra)
        d.setdefault("architectures", ["SDARForCausalLM"])
        return d

    def save(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")
