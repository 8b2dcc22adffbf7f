"""The full-attention runner: LLaDA / Dream folders served like SDAR ones (server.engine.backends.base.Runner).

    runner = FullAttentionRunner.from_pretrained(folder, cache_mode="exact", device="auto", dtype="auto",
                                                 max_batch=16, max_model_len=0)

`create_backend("native", folder, cache_mode=...)` picks it when the folder's config is a full-attention
family (`model_family`: LLaDA's `model_type` "llada", Dream's "Dream"); `server.cache_mode` chooses how
it reuses K/V:

- `exact`: every denoising forward recomputes the whole sequence (prompt, decoded blocks, the current
  block, the masked rest of the answer window) with bidirectional attention, so the log-probabilities
  of the trace are exactly what the trainer's replay recomputes (the replay invariant);
- `prefix` (Fast-dLLM's prefix cache): the K/V of everything before the current block are computed
  by the block's first forward and reused by its later ones: fewer FLOPs, but stale (in full attention
  earlier positions' K/V depend on later tokens), so the trace's log-probabilities differ from the
  replay's; the trainer measures the gap per sample and corrects it (`train.is_correction` tis / mis).

The mode is recorded in `/v1/models` (`cache_mode`, with `family`) and in every trace. A block-causal
(SDAR) folder with `server.cache_mode=prefix` stops at start (`check_cache_mode`): its KV cache is exact.

It is dllm's full-attention runner itself (`dllm.full.runner.FullRunner`, with the server's sequences, stop ids
and top logprobs), so an engine step is Engine -> this runner's `run` -> the model, as for the native
runner: one denoising forward per `run` over the batch's
canvases (the prompt, then max_tokens to whole blocks starting at the prompt's end), as the official LLaDA /
Dream rollouts decode (their schedules, ranking, Dream's shift and first-token rule; `server.further_horizon`
bounds a prefix-cache forward's window, `server.ranking` / `server.rng` pick the confidence and the random
stream), with the Postprocessor and StepOutput of the block-causal path. The server's
sequences are plain ServerSequences: the runner keeps its per-sequence state (canvas, prefix cache) from the
scheduler's admission until the sequence left (`release`); the slots are the scheduler's block manager's.

Budget for the scheduler (`kv_budget`): there is no block-paged cache (exact mode keeps no K/V; the prefix
cache is one sequence's own tensors, freed with it), so slots alone bound the batch (`num_pages=0`): at most
`max_batch` sequences of up to `max_model_len` tokens; the KV-cache sizing keys do not apply. `server.compile` /
`server.cuda_graphs` run the static-shape step (dllm/full/step.py: canvases padded to buckets, one compiled
graph per bucket, CUDA graphs on a GPU; the prefix cache then lives in one preallocated slot buffer of
max_batch x max_model_len positions); `server.rng=official` runs eagerly only (ConfigError naming it).
Top logprobs (OpenAI `logprobs`) replay the finished sequence with `dllm.full.replay.full_trace_hidden`
(one row per denoising step, the exact-mode state; for a prefix-cache sequence that is the exact
distribution, not the cached approximation it was sampled from).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dllm.cache_mode import CACHE_MODES, DEFAULT_CACHE_MODE
from dllm.errors import FieldError
from dllm.full.model import FullAttentionLM
from dllm.full.replay import full_trace_hidden
from dllm.full.runner import FullRunner
from dllm.sampling import SamplingParams
from dllm.weights import load_pretrained
from dlrl_config import ConfigError
from server.engine.backends.base import RunnerInfo
from server.engine.backends.native import DEFAULT_MAX_LEN, ServedRunner, resolve_device, resolve_dtype
from server.engine.sequence import ServerSequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # no types to mypy: it does not follow transformers

log = logging.getLogger("dlrl.server")


def model_family(model_path: str | Path) -> str:
    """`sdar` (block-causal) or a full-attention family (`llada`, `dream`), from the folder's config.json."""
    from dllm.full.config import folder_family

    return folder_family(Path(model_path))


FULL_DEFAULTS = {"cache_mode": DEFAULT_CACHE_MODE, "further_horizon": -1, "ranking": "official", "rng": "counter"}


def check_cache_mode(family: str, cache_mode: str) -> None:
    """ConfigError naming `server.cache_mode` when it is unknown or does not apply to `family`."""
    check_full_options(family, cache_mode=cache_mode)


def check_full_options(family: str, **options: object) -> None:
    """ConfigError naming the server key (`cache_mode`, `further_horizon`, `ranking`, `rng`) when its value is
    unknown or does not apply to `family` (a block-causal SDAR model takes the defaults only)."""
    cache_mode = options.get("cache_mode", DEFAULT_CACHE_MODE)
    if cache_mode not in CACHE_MODES:
        raise ConfigError(f"server.cache_mode: unknown {cache_mode!r} (known: {', '.join(CACHE_MODES)})")
    if family != "sdar":
        return
    for key, value in options.items():
        if value != FULL_DEFAULTS[key]:
            raise ConfigError(f"server.{key}: {value!r} applies to full-attention models (LLaDA, Dream); this "
                              f"block-causal SDAR model's KV cache is exact (leave server.{key}={FULL_DEFAULTS[key]})")


class FullAttentionRunner(ServedRunner, FullRunner):
    """The full-attention runner (server.engine.backends.base.Runner): loads the model, runs batches
    (FullRunner.run: one denoising forward, eager or the static step), scores top logprobs."""

    name = "full_attention"

    def __init__(self, model: FullAttentionLM, tokenizer: PreTrainedTokenizerBase | None, *, max_batch: int,
                 cache_mode: str = DEFAULT_CACHE_MODE, max_model_len: int = 0, eos_ids: list[int] | None = None, further_horizon: int = -1,
                 ranking: str = "official", rng: str = "counter", compile: bool = False,
                 cuda_graphs: bool = False) -> None:
        cfg = model.config
        check_cache_mode(cfg.family, cache_mode)
        self.mask_token_id = cfg.mask_token_id
        limit = max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_LEN)
        try:
            FullRunner.__init__(self, model.eval(), max_batch=max_batch, max_len=limit,
                                eos_ids=sorted(set(cfg.eos_ids if eos_ids is None else eos_ids)), tokenizer=tokenizer,
                                cache_mode=cache_mode, further_horizon=further_horizon, ranking=ranking, rng=rng,
                                compile=compile, cuda_graphs=cuda_graphs)
        except FieldError as e:
            raise ConfigError(f"server.{e.field}: {e.message}") from None
        log.info("full-attention runner: %s, cache_mode=%s, %d sequences of up to %d tokens at once (no paged KV "
                 "cache)", self.family, cache_mode, max_batch, self.max_len)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, cache_mode: str = DEFAULT_CACHE_MODE, further_horizon: int = -1,
                        ranking: str = "official", rng: str = "counter", device: str = "auto",
                        dtype: str = "auto", max_batch: int = 16, max_model_len: int = 0,
                        trust_remote_code: bool = False, block_size: int = 0, mask_token_id: int = -1,
                        compile: bool = False, cuda_graphs: bool = False, **unused: object) -> FullAttentionRunner:
        """Load a LLaDA / Dream folder. `unused`: the block-causal KV-cache sizing options (no paged cache)."""
        from dllm.tokenizer import eos_token_ids, load_tokenizer

        dev = resolve_device(device)
        if cuda_graphs and dev.type != "cuda":
            raise ConfigError(f"server.cuda_graphs: CUDA graphs need a CUDA device (server.device resolves to {dev})")
        model = load_pretrained(path, device=dev, dtype=resolve_dtype(dtype, dev), block_size=block_size or None,
                                mask_token_id=None if mask_token_id < 0 else mask_token_id)
        if not isinstance(model, FullAttentionLM):
            raise ConfigError(f"server.model: {path} is not a full-attention (LLaDA / Dream) folder")
        tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
        log.info("loaded %s (%s) on %s (%s, %.1fM params)", path, model.family, dev, model.dtype,
                 sum(p.numel() for p in model.parameters()) / 1e6)
        eos_ids = eos_token_ids(path, tokenizer, model.config.eos_ids)
        log.info("stop token ids (config.json + generation_config.json + tokenizer): %s", eos_ids)
        return cls(model, tokenizer, max_batch=max_batch, cache_mode=cache_mode, max_model_len=max_model_len,
                   eos_ids=eos_ids, further_horizon=further_horizon, ranking=ranking, rng=rng, compile=compile,
                   cuda_graphs=cuda_graphs)

    @property
    def info(self) -> RunnerInfo:
        return RunnerInfo(self.family, self.cache_mode, note=(
            f"this model is full-attention ({self.family}): prompt log-likelihoods are LLaDA's Monte Carlo ELBO "
            "(dllm.full.likelihood); no prefix sharing: a prompt's K/V depend on what follows it (bidirectional "
            "attention), and there is no paged cache"))

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.validate(prompt_ids, params)

    def _hidden(self, seq: ServerSequence) -> torch.Tensor:
        return full_trace_hidden(self.model, seq)
