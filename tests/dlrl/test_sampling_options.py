"""One SamplingOptions: every config section that samples takes the bounds the server enforces
(dllm.ranges), so a bad value fails that section's own check naming its key, not a later 400."""

from __future__ import annotations

import pytest

from dllm.generate_cli import GenerateConfig
from dllm.options import SamplingOptions
from dllm.ranges import TEMPERATURE, THRESHOLD, TOP_K, TOP_P
from dlrl_config import Config, ConfigError, build
from rollout_client.protocol.common import DecodingOptions
from server.config import ServerConfig
from trainer.align.config import UsersConfig
from trainer.config import TrainConfig
from trainer.eval_cli import EvalConfig

SAMPLING_SECTIONS: list[tuple[type[Config], str]] = [(TrainConfig, "train"), (EvalConfig, "eval"),
                                                     (GenerateConfig, "generate")]


@pytest.mark.parametrize(("cls", "section"), SAMPLING_SECTIONS)
def test_sections_are_sampling_options(cls: type[Config], section: str) -> None:
    assert issubclass(cls, SamplingOptions)
    for key, value in [("temperature", TEMPERATURE.le + 1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
                       ("top_k", 1 << 31)]:
        with pytest.raises(ConfigError, match=rf"config key {section}\.{key}:"):
            build(cls, {key: value}, section)


def test_train_temperature_has_the_servers_upper_bound() -> None:
    """The issue's case: train.temperature=1000 used to pass `dlrl train --check` and fail as a 400."""
    with pytest.raises(ConfigError, match=r"train\.temperature: .*less than or equal to 100"):
        build(TrainConfig, {"temperature": 1000.0}, "train")
    assert build(TrainConfig, {"temperature": TEMPERATURE.le}, "train").temperature == TEMPERATURE.le
    with pytest.raises(ConfigError, match=r"train\.threshold:"):
        build(TrainConfig, {"threshold": THRESHOLD.le + 0.5}, "train")


def test_other_named_keys_share_the_bounds() -> None:
    with pytest.raises(ConfigError, match=r"server\.default_temperature:"):
        build(ServerConfig, {"default_temperature": 101.0}, "server")
    with pytest.raises(ConfigError, match=r"server\.default_threshold:"):
        build(ServerConfig, {"default_threshold": -0.1}, "server")
    with pytest.raises(ConfigError, match=r"users\.temperature:"):
        build(UsersConfig, {"temperature": 1e9}, "users")
    with pytest.raises(ConfigError, match=r"eval\.dynamic_thresholds\.0:"):
        build(EvalConfig, {"dynamic_thresholds": [2.0]}, "eval")


def test_wire_schema_publishes_the_same_bounds() -> None:
    props = DecodingOptions.model_json_schema()["properties"]

    def bounds(name: str) -> dict[str, float]:
        branch = next(b for b in props[name]["anyOf"] if b.get("type") != "null")
        names = {"minimum": "ge", "exclusiveMinimum": "gt", "maximum": "le", "exclusiveMaximum": "lt"}
        return {names[k]: v for k, v in branch.items() if k in names}

    assert bounds("temperature") == TEMPERATURE.bounds
    assert bounds("top_p") == TOP_P.bounds
    assert bounds("top_k") == TOP_K.bounds
    assert bounds("threshold") == THRESHOLD.bounds
    fields = SamplingOptions.model_fields
    assert all(name in DecodingOptions.model_fields for name in fields)
