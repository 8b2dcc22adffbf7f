"""A test double of LMDeploy's PyTorch engine (what server/engine/backends/lmdeploy_runner.py calls), for
CPU tests: no lmdeploy, no CUDA. It stands in for LMDeploy only; every dlrl part is real. It follows the
call paths and statuses of lmdeploy 0.18's source (pytorch/engine/engine.py, engine_instance.py,
executor/{base,uni_executor,ray_executor}.py, model_agent/agent.py, utils.py), so that what fails on the
real library fails here:

    engine = FakeLMDeployEngine(model)                 # executor="uni" (LMDeploy's choice on one GPU) or "ray"
    engine.executor.model_agent                        # uni: the model agent, in this process
    engine.calls                                       # ["sleep(2)", "wakeup(['weights'])", "update_params", ...]
    engine.fail_updates(after=1, times=1)              # the model agent's 2nd update_params from now raises
    engine.executor.released                           # LMDeploy's main task ran its cleanup (executor.release())

- **Executor routing**: `Engine.update_params` forwards to `executor.update_params`; only the Ray executor
  implements it (its workers run the model agent's `update_params` in their own process); the uni executor
  keeps the base class's `NotImplementedError('Not Implemented.')`, its model agent lives in this process.
- **Serialisation**: `serialize_state_dict` / `FlattenedTensorBucket` as lmdeploy.utils: the payload is
  base64 of a ForkingPickler dump whose tensors are reduced to CUDA-IPC-like handles `(rebuild, args)`.
  The model agent's `update_params` deserialises as the real one (`_construct`: `args[6]` set to its
  device, `func(*args)`, cloned unless `require_clone` is False; the bucket's metadata rebuilds the
  tensors). A handle resolves only in another process than the one that made it (the Ray worker):
  torch's `rebuild_cuda_tensor` misses its cache (kept under another key) and CUDA refuses to open an
  IPC handle in the process that created it.
- **Sleep**: `sleep(level)` marks both tags asleep, cancels every request in flight (CANCEL) and drops the
  weights (level 2: the model goes to the meta device, so waking the weights gives an empty-initialised
  model until they are loaded); until every tag is awake again, new requests end with CANCEL and no
  tokens (lmdeploy's blocked request types).
- **Lifecycle**: `start_loop` starts the engine's main task on the running loop; `close` cancels it; the
  task's cleanup first awaits its own tasks' cancellation (`release_after_s`, as EngineLoop.wait_tasks
  awaits cancel_async_tasks), then releases the executor; `wait_tasks` awaits it.

Like `EngineInstance.async_stream_infer`, a request streams SUCCESS outputs of one block of new tokens each,
then FINISH with the rest (a stop token is kept, as LMDeploy's `set_stop_pos` keeps it); `async_cancel` ends
it with CANCEL.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import copy
import enum
import io
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch

from dllm.decoding import generate
from dllm.sampling import SamplingParams
from dllm.weights import copy_into_model
from server.engine.backends.lmdeploy_runner import LMDeployAPI


class ResponseType(enum.Enum):  # lmdeploy.pytorch.engine.request.ResponseType, the members used here
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


# ---------------------------------------------------------------------------------- lmdeploy.utils
@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """lmdeploy.utils.FlattenedTensorBucket: one dtype's tensors packed into one flat tensor."""

    def __init__(self, named_tensors: list[tuple[str, torch.Tensor]] | None = None,
                 flattened_tensor: torch.Tensor | None = None,
                 metadata: list[FlattenedTensorMetadata] | None = None) -> None:
        if named_tensors is not None:
            if len({t.dtype for _, t in named_tensors}) > 1:
                raise ValueError("All tensors should have same dtype")
            self.metadata, start = [], 0
            for name, t in named_tensors:
                self.metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, start, start + t.numel(),
                                                             t.numel()))
                start += t.numel()
            self.flattened_tensor = torch.cat([t.flatten() for _, t in named_tensors])
        else:
            if flattened_tensor is None or metadata is None:
                raise ValueError("Must provide either named_tensors or both flattened_tensor and metadata")
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flattened_tensor

    def get_metadata(self) -> list[FlattenedTensorMetadata]:
        return self.metadata

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(m.name, self.flattened_tensor[m.start_idx:m.end_idx].reshape(m.shape).to(m.dtype))
                for m in self.metadata]


_process: contextvars.ContextVar[str] = contextvars.ContextVar("process", default="server")
_ipc: dict[int, tuple[str, torch.Tensor]] = {}  # handle -> (the process that made it, its memory)
_handles = itertools.count(1)


def reduce_tensor(t: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    """torch.multiprocessing.reductions.reduce_tensor of a CUDA tensor: (rebuild, args), args[6] its device."""
    handle = next(_handles)
    _ipc[handle] = (_process.get(), t)
    return rebuild_ipc_tensor, (type(t), t.shape, t.stride(), t.storage_offset(), None, t.dtype, str(t.device),
                                handle)


def rebuild_ipc_tensor(*args: Any) -> torch.Tensor:
    """torch's rebuild_cuda_tensor: opens the handle -- only in another process than the one that made it."""
    device, handle = args[6], args[7]
    producer, t = _ipc[handle]
    if producer == _process.get():
        raise RuntimeError("CUDA error: invalid device context (a CUDA IPC handle opened in the process that "
                           "created it)")
    return t.to(device)


def serialize_state_dict(state_dict: dict[str, Any]) -> str:
    """lmdeploy.utils.serialize_state_dict: reduce the tensors to IPC handles, ForkingPickler, base64."""
    if "metadata" in state_dict:
        data: Any = dict(state_dict)
        if isinstance(data.get("flattened_tensor"), torch.Tensor):
            data["flattened_tensor"] = reduce_tensor(data["flattened_tensor"])
    else:
        data = [(k, reduce_tensor(v)) for k, v in state_dict.items()]
    buf = io.BytesIO()
    ForkingPickler(buf).dump(data)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def fake_api() -> LMDeployAPI:
    """The runner's LMDeployAPI over these stand-ins (what lmdeploy_runner.lmdeploy_api builds from lmdeploy)."""

    return LMDeployAPI(generation_config=FakeGenerationConfig, update_request=lambda **kw: SimpleNamespace(**kw),
                       flattened_bucket=FlattenedTensorBucket)


# ---------------------------------------------------------------------------------- model agent, executors
class FakeModelAgent:
    """model_agent.BaseModelAgent: the model on the device, its sleep / wakeup / update_params."""

    def __init__(self, model: Any, engine: FakeLMDeployEngine) -> None:
        self.model, self.engine = model, engine
        self.weights_on = "cuda"  # "cuda" | "cpu" (sleep level 1) | "meta" (sleep level 2: dropped)
        self.has_kv_cache = True
        self._ipc_tensor: torch.Tensor | None = None
        self._fail: list[bool] = []  # per coming update_params call: raise?

    async def sleep(self, level: int = 1) -> None:
        self.has_kv_cache = False
        self.weights_on = "cpu" if level == 1 else "meta"
        self._ipc_tensor = None

    def wakeup(self, tags: list[str] | None = None) -> None:
        tags = tags if tags is not None else ["weights", "kv_cache"]
        if "weights" in tags:
            assert self.weights_on in ("cpu", "meta")
            if self.weights_on == "meta":  # rebuilt with empty_init: garbage until update_params loads them
                g = torch.Generator().manual_seed(12345)
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.copy_(torch.randn(p.shape, generator=g))
            self.weights_on = "cuda"
        if "kv_cache" in tags:
            self.has_kv_cache = True

    def update_params(self, request: Any) -> None:
        self.engine.calls.append("update_params" + ("(finished)" if request.finished else ""))
        if self._fail and self._fail.pop(0):
            raise RuntimeError("injected update_params failure")
        if self.weights_on != "cuda":  # the real one copies into meta tensors: the update is lost
            raise RuntimeError("update_params while the weights sleep (wakeup(['weights']) first)")

        def construct(item: tuple[Callable[..., torch.Tensor], tuple[Any, ...]], require_clone: bool) -> torch.Tensor:
            func, args = item
            args_list = list(args)
            args_list[6] = "cpu"  # torch.cuda.current_device() in the real one
            t = func(*args_list)
            return t.clone() if require_clone else t

        weights = ForkingPickler.loads(base64.b64decode(request.serialized_named_tensors))
        if request.load_format == "flattened_bucket":
            if not weights["metadata"]:
                return
            self._ipc_tensor = construct(weights["flattened_tensor"], weights.get("require_clone", True))
            named = FlattenedTensorBucket(flattened_tensor=self._ipc_tensor,
                                          metadata=weights["metadata"]).reconstruct_tensors()
        else:
            named = [(k, construct(v, True)) for k, v in weights]
        with torch.no_grad():
            copy_into_model(self.model, named, strict=False)
        if request.finished:
            self._ipc_tensor = None


class ExecutorBase:
    """sleep / wakeup go to the executor's model agent (`_agent()`: wherever each executor keeps it)."""

    released = False

    def _agent(self) -> FakeModelAgent:
        raise NotImplementedError

    async def sleep(self, level: int = 1) -> None:
        await self._agent().sleep(level)

    def wakeup(self, tags: list[str] | None = None) -> None:
        self._agent().wakeup(tags)

    def update_params(self, request: Any) -> None:
        raise NotImplementedError("Not Implemented.")

    def release(self) -> None:
        self.released = True


class UniExecutor(ExecutorBase):
    """One device, the model agent in this process (`model_agent`: what dlrl looks for); update_params is the
    base class's."""

    def __init__(self, agent: FakeModelAgent) -> None:
        self.model_agent = agent

    def _agent(self) -> FakeModelAgent:
        return self.model_agent


class RayExecutor(ExecutorBase):
    """The model agent in a Ray worker process (no `model_agent` here): update_params is a collective RPC to it."""

    def __init__(self, agent: FakeModelAgent) -> None:
        self._worker = agent

    def _agent(self) -> FakeModelAgent:
        return self._worker

    def update_params(self, request: Any) -> None:
        def in_worker() -> None:
            _process.set("ray-worker")
            self._worker.update_params(request)

        contextvars.copy_context().run(in_worker)


# ---------------------------------------------------------------------------------- engine
class FakeInstance:
    def __init__(self, engine: FakeLMDeployEngine) -> None:
        self.engine = engine

    async def async_stream_infer(self, session_id: int, input_ids: list[int],
                                 gen_config: FakeGenerationConfig | None = None) -> AsyncIterator[EngineOutput]:
        eng, cfg = self.engine, gen_config or FakeGenerationConfig()
        eng.requests.append((session_id, list(input_ids), cfg))
        if eng.sleeping_tags:  # ADD_SESSION / ADD_MESSAGE are blocked: reject_request -> CANCEL
            yield EngineOutput(ResponseType.CANCEL)
            return
        epoch = eng.epoch
        params = SamplingParams(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature if cfg.do_sample else 0.0,
                                top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.random_seed,
                                stop_token_ids=list(cfg.stop_token_ids or []), ignore_eos=cfg.stop_token_ids is None,
                                strategy=eng.strategy, steps=eng.steps, threshold=eng.threshold)
        out = (await asyncio.to_thread(generate, eng.agent.model, [list(input_ids)], params))[0]
        ids, bs = out.completion_ids, eng.agent.model.config.block_size
        for first in range(0, len(ids), bs):
            await asyncio.sleep(0)
            if session_id in eng.cancelled or eng.epoch != epoch:  # stopped, or the engine slept meanwhile
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

    def __init__(self, model: Any, *, executor: str = "uni", strategy: str = "dynamic", steps: int | None = None,
                 threshold: float = 0.9, release_after_s: float = 0.05) -> None:
        self.agent = FakeModelAgent(copy.deepcopy(model).eval(), self)
        self.executor: UniExecutor | RayExecutor = (UniExecutor if executor == "uni" else RayExecutor)(self.agent)
        self.strategy, self.steps, self.threshold = strategy, steps, threshold
        self.release_after_s = release_after_s
        self.calls: list[str] = []
        self.requests: list[tuple[int, list[int], FakeGenerationConfig]] = []
        self.cancelled: set[int] = set()
        self.sleeping_tags: set[str] = set()
        self.epoch = 0  # bumped by sleep: requests in flight then are cancelled
        self._loop_main: asyncio.Task[None] | None = None

    @property
    def model(self) -> Any:
        return self.agent.model

    @property
    def started(self) -> bool:
        return self._loop_main is not None

    def fail_updates(self, *, after: int = 0, times: int = 1) -> None:
        """The model agent's update_params: the next `after` calls succeed, the `times` after them raise."""
        self.agent._fail = [False] * after + [True] * times

    # lifecycle: Engine.start_loop / close / wait_tasks and async_loop's cleanup
    def start_loop(self) -> bool:
        if self._loop_main is None:
            self._loop_main = asyncio.get_running_loop().create_task(self._main(), name="EngineMainLoop")
        return True

    async def _main(self) -> None:
        try:
            await asyncio.Event().wait()  # the engine loop's tasks, until cancelled
        finally:
            await asyncio.sleep(self.release_after_s)  # EngineLoop.wait_tasks awaits its cancelled tasks
            self.executor.release()  # Engine._loop_finally

    def close(self) -> None:
        if self._loop_main is not None:
            self._loop_main.cancel()
        else:
            self.executor.release()

    async def wait_tasks(self) -> None:
        if self._loop_main is not None:
            await self._loop_main

    def create_instance(self) -> FakeInstance:
        return FakeInstance(self)

    # weights: Engine.sleep / wakeup / update_params
    async def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep({level})")
        self.sleeping_tags = {"weights", "kv_cache"}
        self.epoch += 1  # _cancel_and_end_all_sessions
        await self.executor.sleep(level)

    def wakeup(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wakeup({tags})")
        self.executor.wakeup(tags)
        self.sleeping_tags -= set(tags if tags is not None else self.sleeping_tags)

    def update_params(self, request: Any) -> None:
        self.calls.append("Engine.update_params")
        self.executor.update_params(request)

