"""The ranges and defaults of the sampling parameters, defined once (torch-free).

The decoder's own check (`SamplingParams.validate`), the wire schemas' bounds
(`rollout_client.protocol.common.DecodingOptions`, published in the OpenAPI document) and every
config section's sampling keys (`dllm.options.SamplingOptions`) read them, so a request the schema
accepts is one the decoder accepts, and a config that passes its check is one the server accepts.
Their defaults too: what a request, a config key or the replay leaves unset (`TEMPERATURE.default`).

    TEMPERATURE.bounds      # {"ge": 0.0, "le": 100.0}: keyword arguments of pydantic's Field
    0.5 in TOP_P            # True
    str(TOP_P)              # "(0, 1]": how error messages state it
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Range:
    """A closed or half-open interval of numbers: `ge`/`gt` below, `le` above; `default`: the value where
    none is given (wire, configs, decoder, replay)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    default: float = 0.0

    @property
    def bounds(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None and k != "default"}

    def __contains__(self, x: float) -> bool:
        return ((self.ge is None or x >= self.ge) and (self.gt is None or x > self.gt)
                and (self.le is None or x <= self.le) and (self.lt is None or x < self.lt))

    def __str__(self) -> str:
        low = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}"
        return f"{low}, {self.le:g}]" if self.le is not None else f"{low}, {self.lt:g})"


TEMPERATURE = Range(ge=0.0, le=100.0, default=1.0)  # 0 = greedy (below dllm.sampling.GREEDY_BELOW too)
TOP_P = Range(gt=0.0, le=1.0, default=1.0)          # 1 = off
THRESHOLD = Range(ge=0.0, le=1.0, default=0.9)      # confidence a `dynamic` step commits above
TOP_K = Range(ge=0, lt=1 << 31, default=0)          # 0 = off; an int32 on the device
