"""The sampling options as pydantic field types and one model, their bounds and defaults from `dllm.ranges`
(torch-free).

Every config section that samples (`generate`, `train`, `eval`) is a `SamplingOptions`, and the
sections or wire schemas whose keys are named otherwise (`server.default_temperature`,
`users.temperature`, `DecodingOptions` where each key may be null) use its field types, so the
bounds are written once and a config that passes its own check is one the server accepts:

    class EvalConfig(Config, SamplingOptions):
        temperature: Temperature = 0.0  # sampling temperature (0 = greedy): only the default changes
    build(TrainConfig, {"temperature": 1e3}, "train")   # ConfigError: config key train.temperature: ...
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from dllm.ranges import TEMPERATURE, THRESHOLD, TOP_K, TOP_P

Temperature = Annotated[float, Field(**TEMPERATURE.bounds)]
TopK = Annotated[int, Field(**{k: int(v) for k, v in TOP_K.bounds.items()})]
TopP = Annotated[float, Field(**TOP_P.bounds)]
Threshold = Annotated[float, Field(**THRESHOLD.bounds)]


class SamplingOptions(BaseModel):
    """The distribution a token is sampled from: temperature, top-k, top-p (mask token excluded)."""

    temperature: Temperature = TEMPERATURE.default  # sampling temperature (0 = greedy)
    top_k: TopK = int(TOP_K.default)  # top-k (0 = off)
    top_p: TopP = TOP_P.default  # nucleus p (1 = off)
