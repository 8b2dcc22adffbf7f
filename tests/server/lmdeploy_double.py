"""A test double of LMDeploy's PyTorch engine interface (what server/engine/backends/lmdeploy_runner.py
calls), for CPU tests: no lmdeploy, no CUDA. It stands in for LMDeploy only; every dlrl part is real.

    engine = FakeLMDeployEngine(model)          # decodes with dllm's generate on its own copy of `model`
    runner = LMDeployRunner(engine, fake_api(), host_model, tokenizer, settings=..., eos_ids=[0], ...)
    engine.calls                                # ["sleep(2)", "wakeup(['weights'])", "update_params", ...]
    engine.fail_in = 1                          # the second update_params call from now raises (once)

Like LMDeploy's `EngineInstance.async_stream_infer`, a request streams SUCCESS outputs of one
block of new tokens each, then FINISH with the rest (a stop token is kept, as LMDeploy's
`set_stop_pos` keeps it); `async_cancel` makes it end with CANCEL. Like `Engine.sleep` /
`wakeup` / `update_params`, updates are refused unless the weights are awake and the KV cache
asleep (DiRL's order), and a sleeping engine refuses requests.
"""

from __future__ import annotations

import asyncio
import copy
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from dllm.decoding import generate
from dllm.sampling import SamplingParams
from dllm.weights import copy_into_model
from server.engine.backends.lmdeploy_runner import LMDeployAPI


class ResponseType(enum.Enum):  # lmdeploy.messages.ResponseType, the members the runner reads
    SUCCESS = enum.auto()
    FINISH = enum.auto()
    CANCEL = enum.auto()
    INTERNAL_ENGINE_ERROR = enum.auto()


@dataclass
class FakeGenerationConfig:  # the lmdeploy.GenerationConfig fields the runner sets
    max_new_tokens: int = 512
    do_sample: bool = False
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 1.0
    random_seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    bad_token_ids: list[int] | None = None
    skip_special_tokens: bool = True


@dataclass
class EngineOutput:
    status: ResponseType
    token_ids: list[int] = field(default_factory=list)


def fake_api() -> LMDeployAPI:
    return LMDeployAPI(generation_config=FakeGenerationConfig, update_request=lambda **kw: SimpleNamespace(**kw),
                       serialize_bucket=lambda named: [(n, t.detach().clone()) for n, t in named])


class FakeInstance:
    def __init__(self, engine: FakeLMDeployEngine) -> None:
        self.engine = engine

    async def async_stream_infer(self, session_id: int, input_ids: list[int],
                                 gen_config: FakeGenerationConfig | None = None) -> AsyncIterator[EngineOutput]:
        eng, cfg = self.engine, gen_config or FakeGenerationConfig()
        eng.requests.append((session_id, list(input_ids), cfg))
        if eng.tags:
            yield EngineOutput(ResponseType.INTERNAL_ENGINE_ERROR)
            return
        params = SamplingParams(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature if cfg.do_sample else 0.0,
                                top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.random_seed,
                                stop_token_ids=list(cfg.stop_token_ids or []), ignore_eos=cfg.stop_token_ids is None,
                                strategy=eng.strategy, steps=eng.steps, threshold=eng.threshold)
        out = (await asyncio.to_thread(generate, eng.model, [list(input_ids)], params))[0]
        ids, bs = out.completion_ids, eng.model.config.block_size
        for first in range(0, len(ids), bs):
            await asyncio.sleep(0)
            if session_id in eng.cancelled:
                yield EngineOutput(ResponseType.CANCEL)
                return
            last = first + bs >= len(ids)
            yield EngineOutput(ResponseType.FINISH if last else ResponseType.SUCCESS, ids[first:first + bs])
        if not ids:
            yield EngineOutput(ResponseType.FINISH)

    async def async_cancel(self, session_id: int) -> None:
        self.engine.cancelled.add(session_id)


class FakeLMDeployEngine:
    """lmdeploy.pytorch.engine.Engine's interface over dllm's own decoding of a private model copy."""

    def __init__(self, model: Any, *, strategy: str = "dynamic", steps: int | None = None,
                 threshold: float = 0.9) -> None:
        self.model = copy.deepcopy(model).eval()
        self.strategy, self.steps, self.threshold = strategy, steps, threshold
        self.calls: list[str] = []
        self.requests: list[tuple[int, list[int], FakeGenerationConfig]] = []
        self.cancelled: set[int] = set()
        self.tags: set[str] = set()  # sleeping: "weights", "kv_cache"
        self.fail_in: int | None = None  # update_params calls from now until one raises (once)
        self.started = self.closed = False

    def start_loop(self) -> bool:
        self.started = True
        return True

    def create_instance(self) -> FakeInstance:
        return FakeInstance(self)

    async def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep({level})")
        self.tags = {"weights", "kv_cache"}

    def wakeup(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wakeup({tags})")
        self.tags -= set(tags or self.tags)

    def update_params(self, request: Any) -> None:
        self.calls.append("update_params" + ("(finished)" if request.finished else ""))
        if "weights" in self.tags or "kv_cache" not in self.tags:
            raise RuntimeError(f"update_params out of order: sleeping {sorted(self.tags)}")
        if self.fail_in is not None:
            self.fail_in -= 1
            if self.fail_in < 0:
                self.fail_in = None
                raise RuntimeError("injected update_params failure")
        assert request.load_format == "flattened_bucket"
        with torch.no_grad():
            copy_into_model(self.model, request.serialized_named_tensors, strict=False)

    def close(self) -> None:
        self.closed = True
