"""The native backend: dllm's block-causal runner (`dllm.runner.BlockRunner`: PyTorch, its static decode step,
SDPA; bf16 on CUDA), loaded from a folder, with the KV cache sized from memory.

    backend = NativeBackend.from_pretrained("runs/tiny/model", device="auto", dtype="auto", max_batch=16,
                                            max_model_len=0, kv_cache_memory=0, kv_cache_fraction=0.8,
                                            trust_remote_code=False, compile=False, cuda_graphs=False,
                                            prefix_caching=True)

It is the runner itself (a BlockRunner with the server's sequences, stop ids and top logprobs), so an
engine step is Engine -> this runner's `run` -> the model's step (dllm.step.decode_step).
`prefix_caching` (server.prefix_caching, on by default) shares complete prompt blocks across the
samples of a request and across requests, keyed by their tokens and the weight version
(dllm.block_manager); off, every sequence computes and holds its own prompt.

`compile` (server.compile) runs the decode step through torch.compile; `cuda_graphs`
(server.cuda_graphs, CUDA only, a ConfigError elsewhere) captures it per bucket (dllm/step.py).

The KV cache is sized from memory (`plan_kv_cache`): `kv_cache_memory` bytes (e.g. 4 << 30;
server.kv_cache_memory takes "4GiB") if not 0, else `kv_cache_fraction` of the memory
available once the weights are loaded (free device memory on CUDA; on CPU available RAM
less the `keep_versions` host copies of the weights kept for rollback), never more than `max_batch` sequences of `max_model_len` need. It is block-paged, so a
sequence holds only the pages of its own prompt + max_tokens: how many run at once follows
their real lengths (at most `max_batch`). The plan is logged at startup; when one sequence of
`max_model_len` does not fit, startup stops with a ConfigError naming the options to change.

Generation stops at the union of config.json's, generation_config.json's and the
tokenizer's eos ids (`backend.eos_ids`; chat checkpoints end turns with `<|im_end|>`); a
request's `stop_token_ids` add to them, as in vLLM. The folder's own Python code runs only
with `trust_remote_code=True` (never a prompt on stdin).

Top logprobs (`top_logprobs`, OpenAI `logprobs`) replay the finished sequence's trace
(`dllm.replay.trace_hidden`: one forward row per denoising step of its blocks, the DESIGN's
replay invariant) and apply the request's temperature / top-k / top-p
(`dllm.sampling.sampling_logprobs`) to TOP_LOGPROBS_CHUNK tokens' logits at a time: only
requests that ask for them pay that forward.

The scheduler's post-processor gets its own tokenizer instance (`postprocessor()`: it decodes
text and applies stop strings in the engine thread) while `backend.tokenizer` is used by HTTP
handlers on the event loop, so no tokenizer object is shared between threads. The scheduler's
block manager accounts for every slot and page (`kv_budget`); the runner keeps no account.

`trace_free` (server.trace_free) withholds the traces: every sequence is marked trace-free and
published with 0 steps / logprobs, as the lmdeploy backend's are (tests of the trace-free path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from dllm.kv_cache import KVCache
from dllm.model import SDARForCausalLM
from dllm.replay import trace_hidden
from dllm.runner import BlockRunner
from dllm.sampling import SamplingParams, sampling_logprobs
from dllm.weights import load_pretrained, parse_dtype
from dlrl_config import ConfigError
from server.engine.backends.base import RunnerInfo
from server.engine.sequence import ServerSequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # no types to mypy: it does not follow transformers

    from dllm.config import SDARConfig
    from dllm.weights import DiffusionLM

log = logging.getLogger("dlrl.server")
DEFAULT_MAX_LEN = 8192
TOP_LOGPROBS_CHUNK = 64  # completion tokens whose full-vocabulary logits exist at once (top_logprobs)
GIB = float(1 << 30)


def resolve_device(device: str) -> torch.device:
    if device in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype in ("", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return parse_dtype(dtype)


def available_memory(device: torch.device, host_reserve: int = 0) -> int:
    """Bytes the KV cache could take: free device memory on CUDA, available RAM otherwise
    (less `host_reserve`, host memory promised to something else: kept weight versions)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return max(psutil.virtual_memory().available - host_reserve, 0)


@dataclass
class KVPlan:
    num_pages: int
    page_tokens: int
    bytes_per_token: int
    max_len: int
    max_batch: int
    budget: str  # where the budget came from

    @property
    def num_bytes(self) -> int:
        return self.num_pages * self.page_tokens * self.bytes_per_token

    @property
    def num_full_sequences(self) -> int:
        """Sequences of max_model_len that fit at once."""
        return self.num_pages // -(-self.max_len // self.page_tokens)

    def describe(self) -> str:
        tokens = self.num_pages * self.page_tokens
        return (f"KV cache {self.num_bytes / GIB:.3f} GiB ({self.budget}): {self.num_pages:,} pages of "
                f"{self.page_tokens} tokens = {tokens:,} tokens at {self.bytes_per_token / 1024:.1f} KiB/token; "
                f"{min(self.num_full_sequences, self.max_batch)} sequences of max_model_len={self.max_len} at "
                f"once, up to max_batch={self.max_batch} when shorter")


def plan_kv_cache(cfg: SDARConfig, dtype: torch.dtype, *, max_batch: int, max_len: int, memory: int, fraction: float,
                  available: int) -> KVPlan:
    """Pages of the KV cache from a memory budget; ConfigError when one max_len sequence does not fit."""
    per_token = KVCache.bytes_per_token(cfg, dtype)
    page_bytes = per_token * cfg.block_size
    pages_per_seq = -(-max_len // cfg.block_size)
    if memory:
        budget, source = memory, f"server.kv_cache_memory={memory / GIB:.3f} GiB"
    else:
        budget = int(fraction * available)
        source = f"server.kv_cache_fraction={fraction} of {available / GIB:.2f} GiB available"
    num_pages = min(budget // page_bytes, max_batch * pages_per_seq)
    if num_pages < pages_per_seq:
        need = pages_per_seq * page_bytes
        raise ConfigError(
            f"KV cache: one sequence of max_model_len={max_len} tokens needs {need / GIB:.3f} GiB, but the cache "
            f"may use {budget / GIB:.3f} GiB ({source}); raise server.kv_cache_memory or "
            f"server.kv_cache_fraction, or lower server.max_model_len")
    if num_pages == max_batch * pages_per_seq:
        source += f"; capped at max_batch={max_batch} x max_model_len={max_len}"
    return KVPlan(num_pages, cfg.block_size, per_token, max_len, max_batch, source)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@torch.no_grad()
def top_logprobs_of(model: DiffusionLM, hidden: torch.Tensor, params: SamplingParams, mask_token_id: int,
                    k: int) -> list[list[tuple[int, float]]]:
    """Top-k (token id, logprob) per completion token from the hidden states that committed them ([C, D]),
    under the request's sampling distribution; chunked over tokens (the full-vocabulary logits are big)."""
    out: list[list[tuple[int, float]]] = []
    for first in range(0, hidden.shape[0], TOP_LOGPROBS_CHUNK):
        logits = model.lm_head(hidden[first:first + TOP_LOGPROBS_CHUNK])
        logp = sampling_logprobs(logits, params, mask_token_id)  # [chunk, V]
        values, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)  # [chunk, k]
        out += [[(t, v) for t, v in zip(row_ids, row_values) if v > float("-inf")]
                for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    return out


M = TypeVar("M", bound="DiffusionLM")  # the runner's model class


class ServedRunner(Generic[M]):
    """What the server's runners share: sequences in (a request's stop ids add to the eos ids), trace-free
    marking, top logprobs from the trace's replay (`_hidden`)."""

    model: M
    tokenizer: PreTrainedTokenizerBase | None
    eos_ids: list[int]
    block_size: int
    mask_token_id: int
    trace_free = False  # server.trace_free: withhold traces (Trace.trace_free; tests, evaluation)

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """FieldError for a prompt or parameters the runner cannot run (each runner's own checks)."""
        raise NotImplementedError

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, seq_id: int | None = None) -> ServerSequence:
        if params.stop_token_ids is not None and not params.ignore_eos:  # vLLM: they add to the eos ids
            params.stop_token_ids = sorted(set(self.eos_ids) | set(params.stop_token_ids))
        self._check(prompt_ids, params)
        seq = ServerSequence(prompt_ids, params, self.block_size, self.mask_token_id, seq_id)
        seq.trace.trace_free = self.trace_free  # published with 0 steps / logprobs (Trace.published)
        return seq

    def _hidden(self, seq: ServerSequence) -> torch.Tensor:
        """The final hidden states at the sequence's completion positions, replayed from its trace."""
        raise NotImplementedError

    @torch.no_grad()
    def top_logprobs(self, seq: ServerSequence, k: int) -> list[list[tuple[int, float]]]:
        return top_logprobs_of(self.model, self._hidden(seq), seq.params, self.mask_token_id, k)


class NativeBackend(ServedRunner[SDARForCausalLM], BlockRunner):
    """The native runner (server.engine.backends.base.Runner): loads the model, plans the KV cache, runs
    batches (BlockRunner.run: the static decode step / CUDA graphs below), scores top logprobs."""

    name = "native"

    def __init__(self, model: SDARForCausalLM, tokenizer: PreTrainedTokenizerBase | None, *, max_batch: int,
                 max_model_len: int = 0,
                 eos_ids: list[int] | None = None, kv_cache_memory: int = 0, kv_cache_fraction: float = 0.8,
                 keep_versions: int = 0, compile: bool = False, cuda_graphs: bool = False, trace_free: bool = False,
                 kv_admission: str = "reserve", prefix_caching: bool = True):
        cfg = model.config
        self.trace_free = trace_free
        if cuda_graphs and model.device.type != "cuda":
            raise ConfigError(f"server.cuda_graphs: needs a CUDA device (the model is on {model.device})")
        self.eos_ids = sorted(set(cfg.eos_ids if eos_ids is None else eos_ids))
        self.mask_token_id = cfg.mask_token_id
        # 0 = the model's limit, capped at DEFAULT_MAX_LEN; set server.max_model_len to go higher
        max_len = max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_LEN)
        self.kv_plan = plan_kv_cache(cfg, model.dtype, max_batch=max_batch, max_len=max_len,
                                     memory=int(kv_cache_memory), fraction=kv_cache_fraction,
                                     available=available_memory(model.device, keep_versions * weight_bytes(model)))
        log.info("%s; prefix caching %s", self.kv_plan.describe(), "on" if prefix_caching else "off")
        BlockRunner.__init__(self, model.eval(), max_batch=max_batch, max_len=max_len, eos_ids=self.eos_ids,
                             tokenizer=tokenizer, num_pages=self.kv_plan.num_pages, compile=compile,
                             cuda_graphs=cuda_graphs, optimistic=kv_admission == "optimistic",
                             prefix_sharing=prefix_caching)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str = "auto", dtype: str = "auto",
                        max_batch: int = 16, max_model_len: int = 0, trust_remote_code: bool = False,
                        block_size: int = 0, mask_token_id: int = -1, kv_cache_memory: int = 0,
                        kv_cache_fraction: float = 0.8, keep_versions: int = 0, compile: bool = False,
                        cuda_graphs: bool = False, trace_free: bool = False, kv_admission: str = "reserve",
                        prefix_caching: bool = True) -> NativeBackend:
        from dllm.tokenizer import eos_token_ids, load_tokenizer

        dev = resolve_device(device)
        model = load_pretrained(path, device=dev, dtype=resolve_dtype(dtype, dev), block_size=block_size or None,
                                mask_token_id=None if mask_token_id < 0 else mask_token_id)
        if not isinstance(model, SDARForCausalLM):  # server.engine.backends.create_backend picks by family
            raise ConfigError(f"server.model: {path} is a full-attention folder, not a block-causal (SDAR) one")
        tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
        log.info("loaded %s on %s (%s, %.1fM params)", path, dev, model.dtype,
                 sum(p.numel() for p in model.parameters()) / 1e6)
        eos_ids = eos_token_ids(path, tokenizer, model.config.eos_ids)
        log.info("stop token ids (config.json + generation_config.json + tokenizer): %s", eos_ids)
        return cls(model, tokenizer, max_batch=max_batch, max_model_len=max_model_len, eos_ids=eos_ids,
                   kv_cache_memory=kv_cache_memory, kv_cache_fraction=kv_cache_fraction, keep_versions=keep_versions,
                   compile=compile, cuda_graphs=cuda_graphs, trace_free=trace_free, kv_admission=kv_admission,
                   prefix_caching=prefix_caching)

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.validate(prompt_ids, params)

    @property
    def info(self) -> RunnerInfo:
        return RunnerInfo("sdar", prefix_sharing=self.kv_budget.prefix_sharing)

    @property
    def optimistic(self) -> bool:
        return self.kv_budget.optimistic

    def _hidden(self, seq: ServerSequence) -> torch.Tensor:
        return trace_hidden(self.model, seq)
