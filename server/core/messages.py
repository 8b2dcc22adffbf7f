"""The typed messages between API processes and the engine core (msgspec structs, MessagePack on the wire).

    data = encode(Submit(rid=7, seqs=[SeqSpec(...)], stream=True))     # API -> core
    msg = decode_to_core(data)                                          # a ToCore union member
    data = encode(Outputs(events=[Update(7, 0, [12, 40])], load=Load(...)))   # core -> API: one per step
    msg = decode_to_api(data)                                           # a ToApi union member

Every message is a tagged struct, decoded straight into its type (no pickle, nothing executed): an
unknown tag or a wrong field type is a `msgspec.ValidationError`. The hot ones are array-like (no
field names on the wire): a step's outputs for every sequence of an API process go out as ONE
`Outputs` message (new token ids of streamed sequences, the final record of ended ones, the core's
load). Calls that expect an answer carry a `cid` that the `Reply` echoes; the reply's `value` is
left encoded (`msgspec.Raw`) and decoded by the caller into the type it expects. A weight-update
bucket's bytes travel as a raw second frame after its `BucketData` header (server.core.channel).
"""

from __future__ import annotations

from typing import Literal, TypeVar

import msgspec

from server.engine.retry_after import Forecast

# ------------------------------------------------------------------------------------------ shared parts


class _Message(msgspec.Struct, tag=True, array_like=True):
    """A top-level message: tagged with its class name, fields by position."""


class Params(msgspec.Struct, array_like=True):
    """dllm.sampling.SamplingParams of one sequence."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    strategy: str
    steps: int | None
    threshold: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int] | None
    ignore_eos: bool
    logit_bias: dict[int, float] | None = None


class SeqSpec(msgspec.Struct, array_like=True):
    """A sequence to run, as the API process built and checked it."""

    prompt_ids: list[int]
    params: Params
    deadline: float | None = None  # time.monotonic() (one clock on a host) by which its request must end
    deadline_status: int = 0


class Error(msgspec.Struct):
    """A failure carried back: `kind` picks the exception the client raises (server.core.client)."""

    kind: str            # field, too_long, queue_full, stopped, http, failed
    message: str
    field: str | None = None
    status: int = 0      # the HTTP status (kind "http": a weight call's mapped status)
    retry_after: int = 0


# One prompt's scores (dllm.likelihood.TokenScores): logprobs, top-k, forward rows, ELBO standard errors, samples
Scored = tuple[list[float | None], list[list[tuple[int, float]]] | None, int, list[float | None] | None, int | None]


class RunnerFacts(msgspec.Struct):
    """What the API needs to know of the runner (the names of server.engine.backends.base.Runner)."""

    name: str
    block_size: int
    vocab_size: int
    mask_token_id: int
    max_batch: int
    max_len: int
    has_top_logprobs: bool
    family: str
    cache_mode: str | None
    has_likelihoods: bool = True  # the rest of server.engine.backends.base.RunnerInfo
    prefix_sharing: bool = False
    weights: Literal["copy", "runner"] = "copy"
    note: str = ""


class Facts(msgspec.Struct):
    """The served model and engine, fixed for the core's life."""

    model_path: str
    runner: RunnerFacts
    max_model_len: int
    max_queue: int
    max_queue_tokens: int
    kv_num_slots: int
    kv_num_pages: int
    kv_page_tokens: int
    kv_optimistic: bool
    attention: str        # "full" (LLaDA / Dream) or "block" (SDAR)
    dtype: str
    core_pid: int


class Load(msgspec.Struct, array_like=True):
    """The core's live state, sent with every Outputs (and every HEARTBEAT_S when nothing else goes)."""

    at: float             # time.monotonic() in the core
    version: int
    state: str            # server.engine.engine.EngineState
    model_name: str
    num_running: int
    num_waiting: int
    waiting_tokens: int
    num_free_slots: int
    free_pages: int
    forecast: Forecast | None = None  # only while the queue is at least half full (server.engine.retry_after)


class TraceEnd(msgspec.Struct, array_like=True):
    """A finished sequence's trace (dllm.trace.Trace), minus what the API knows (prompt_len, block_size)."""

    steps: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str | None
    tail_ids: list[int]
    tail_steps: list[int]
    cache_mode: str | None
    canvas_len: int | None
    trace_free: bool
    backend: str
    block_origin: int = 0
    schedule: str | None = None
    further_horizon: int | None = None
    logit_bias: dict[int, float] | None = None


class Family(msgspec.Struct, array_like=True):
    """One Prometheus metric family of a process's registry."""

    name: str
    type: str
    documentation: str
    samples: list[tuple[str, dict[str, str], float]]


# ------------------------------------------------------------------------------------------ API -> core


class Hello(_Message):
    cid: int
    pid: int
    index: int


class Goodbye(_Message):
    """The API process is stopping (drained): forget it without alarm."""


class Submit(_Message):
    rid: int  # the request's id in its API process (the reply's cid too)
    seqs: list[SeqSpec]
    stream: bool = False
    num_top_logprobs: int = 0


class Abort(_Message):
    rid: int


class AbortAll(_Message):
    cid: int


class Pause(_Message):
    cid: int
    abort_inflight: bool = False


class Resume(_Message):
    cid: int


class SetModelName(_Message):
    cid: int
    name: str


class Score(_Message):
    """Prompt log-likelihoods (dllm.likelihood.prompt_logprobs), each prompt between two engine steps."""

    cid: int
    prompts: list[list[int]]
    method: Literal["sequential", "elbo"]  # dllm.likelihood.Method
    top_k: int
    num_samples: int
    seed: int


class Metrics(_Message):
    cid: int


class MetricsPush(_Message):
    """An API process's families, every METRICS_PUSH_S when there are several (the core keeps the last)."""

    families: list[Family]


class Weights(_Message):
    """A weight-sync control call (server.weights.weight_updates.WeightUpdates), forwarded as it came:
    `body` is the route's pydantic request (weight_sync.protocol) as JSON, or {} for the queries."""

    cid: int
    op: str    # connect, begin, commit, abort, status, state, checksum, rollback, kept
    body: bytes = b"{}"


class BucketOpen(_Message):
    """PUT /weights/bucket/{index} begins: the core takes the staging buffer (ownership checked first)."""

    cid: int
    sid: int
    index: int
    version: int | None
    checksum: int | None
    run_id: str


class BucketData(_Message):
    """Header of a body chunk; the chunk is the next frame, copied once, into the staging buffer."""

    sid: int


class BucketEnd(_Message):
    cid: int
    sid: int
    ok: bool = True  # False: the body failed half-way (the bucket is released)


ToCore = (Hello | Goodbye | Submit | Abort | AbortAll | Pause | Resume | SetModelName | Score | Metrics | MetricsPush | Weights
          | BucketOpen | BucketData | BucketEnd)

# ------------------------------------------------------------------------------------------ core -> API


class Update(_Message):
    """A streamed sequence committed a block: its new completion ids."""

    rid: int
    index: int
    ids: list[int]


class Done(_Message):
    """A sequence ended: the ids not sent yet and everything the response and the record read."""

    rid: int
    index: int
    ids: list[int]
    trace: TraceEnd
    error: str | None
    num_forwards: int
    top_logprobs: list[list[tuple[int, float]]] | None
    stop_token_ids: list[int] | None
    times: tuple[float | None, float | None, float | None, float | None]  # arrived, admitted, first, finished


class Failed(_Message):
    """A sequence failed (a failed forward, a deadline): its request's error."""

    rid: int
    index: int
    message: str
    expired: str = ""       # the deadline's reason when it expired
    deadline_status: int = 0


Event = Update | Done | Failed


class Outputs(_Message):
    events: list[Event]
    load: Load


class Welcome(_Message):
    cid: int
    facts: Facts
    load: Load


class Reply(_Message):
    cid: int
    value: msgspec.Raw = msgspec.Raw(b"\xc0")  # MessagePack nil
    error: Error | None = None


class Credit(_Message):
    """The core consumed `nbytes` of bucket stream `sid` (flow control of the http data plane)."""

    sid: int
    nbytes: int


ToApi = Outputs | Welcome | Reply | Credit

T = TypeVar("T")
_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_to_api = msgspec.msgpack.Decoder(ToApi)


def encode(msg: object) -> bytes:  # a message, or a reply's value (anything msgspec encodes)
    return _encoder.encode(msg)


def encode_json(obj: object) -> bytes:
    return msgspec.json.encode(obj)


def decode_to_core(data: bytes | memoryview) -> ToCore:
    return _to_core.decode(data)


def decode_to_api(data: bytes | memoryview) -> ToApi:
    return _to_api.decode(data)


def value(reply: Reply, kind: type[T]) -> T:
    """The reply's value decoded as `kind`."""
    return msgspec.msgpack.decode(reply.value, type=kind)


__all__ = ["Abort", "AbortAll", "BucketData", "BucketEnd", "BucketOpen", "Credit", "Done", "Error", "Event",
           "Facts", "Failed", "Family", "Goodbye", "Hello", "Load", "Metrics", "MetricsPush", "Outputs", "Params", "Pause",
           "Reply", "Resume", "RunnerFacts", "Score", "Scored", "SeqSpec", "SetModelName", "Submit", "ToApi", "ToCore",
           "TraceEnd", "Update", "Weights", "Welcome", "decode_to_api", "decode_to_core", "encode", "encode_json", "value"]
