"""Per-key quotas on the generation API: optional API keys with request and token rates and a
concurrency cap; a concurrency cap on POST /v1/feedback.

    # keys.yaml (server.api_keys_file; or the same YAML/JSON inline in env DLRL_API_KEYS)
    keys:
      alice: {key: "sk-alice-...", requests_per_s: 5, tokens_per_s: 4000, max_concurrent: 4}
      batch: {key: "sk-batch-...", tokens_per_s: 20000}            # 0 / missing = unlimited

With keys configured, `/generate`, `/v1/completions` and `/v1/chat/completions` need
`Authorization: Bearer <key>` (what the OpenAI client sends as `api_key`): none is 401, an
unknown key 403 (compared in constant time). The admin token is also accepted there,
without quota (the trainer's rollouts). Over a limit is a 429 with `Retry-After`: the
request rate and the concurrency cap are checked before the body is read; the token rate
charges prompt + max_tokens of every sequence once the request is tokenised
(`charge_tokens`, from server.api.generation.prepare; buckets hold `burst_s` seconds of rate).
`server.max_concurrent_feedback` (0 = unlimited) caps feedback calls in flight, whoever
sends them. The feedback and admin tokens keep their roles: keys open nothing else.
Without keys the generation API is open, as before.
With `server.api_processes` N > 1 each API process enforces its share (`share` = 1/N): a key's rates
refill at 1/N of theirs in each (bursts up to the key's whole bucket), its concurrency cap and the
feedback cap are divided, rounded up; the kernel spreads connections over the processes, so a key's
traffic meets the whole limit when its connections are spread too (one connection: its process's share).
"""

from __future__ import annotations

import contextvars
import hmac
import math
import os
import threading
import time
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dlrl_config import ConfigError
from server.api.errors import APIError

ENV_VAR = "DLRL_API_KEYS"
# the key of the request being served (set by server.api.gate.RefusalGate; read by charge_tokens)
current_key: contextvars.ContextVar[KeyState | None] = contextvars.ContextVar("dlrl_api_key", default=None)


class KeySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str = Field(min_length=16)
    requests_per_s: float = Field(0.0, ge=0)
    tokens_per_s: float = Field(0.0, ge=0)
    max_concurrent: int = Field(0, ge=0)
    burst_s: float = Field(1.0, gt=0, le=3600)  # bucket size in seconds of rate


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keys: dict[str, KeySpec] = Field(min_length=1)


class Bucket:
    """A token bucket: `rate` per second, holding at most rate x burst_s (at least `floor`) or `capacity`."""

    def __init__(self, rate: float, burst_s: float, floor: float = 1.0, capacity: float | None = None):
        self.rate, self.capacity = rate, max(rate * burst_s if capacity is None else capacity, floor)
        self.level, self.t = self.capacity, time.monotonic()

    def take(self, amount: float) -> float:
        """Take `amount` and return 0, or take nothing and return the seconds until it is there."""
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
        self.t = now
        if amount <= self.level:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate


class KeyState:
    def __init__(self, name: str, spec: KeySpec, share: float = 1.0):
        """`share`: this process's part of the key's rates and concurrency (1/server.api_processes)."""
        self.name, self.spec, self.in_flight = name, spec, 0
        self.max_concurrent = math.ceil(spec.max_concurrent * share)
        self.requests = Bucket(spec.requests_per_s * share, spec.burst_s, capacity=spec.requests_per_s * spec.burst_s) \
            if spec.requests_per_s else None
        self.tokens = Bucket(spec.tokens_per_s * share, spec.burst_s, capacity=spec.tokens_per_s * spec.burst_s) \
            if spec.tokens_per_s else None


def load_keys(path: str) -> dict[str, KeySpec]:
    """The keys of `server.api_keys_file`, else of env DLRL_API_KEYS; {} when neither is set."""
    where, text = (f"server.api_keys_file ({path})", None) if path else (f"env {ENV_VAR}", os.environ.get(ENV_VAR))
    if path:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"server.api_keys_file: cannot read {path!r}: {e}") from None
    if not text or not text.strip():
        return {}
    try:
        parsed = KeysFile.model_validate(yaml.safe_load(text))
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not YAML/JSON: {e}") from None
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"{where}: {loc}: {err['msg']}") from None
    keys = [s.key for s in parsed.keys.values()]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"{where}: two names share one key")
    return parsed.keys


class Quotas:
    def __init__(self, keys: dict[str, KeySpec], admin_token: str = "", feedback_token: str = "",
                 max_concurrent_feedback: int = 0, share: float = 1.0):
        for name, spec in keys.items():
            if spec.key in (admin_token, feedback_token) and spec.key:
                raise ConfigError(f"api key {name!r}: must differ from the admin and feedback tokens")
        self.keys = [KeyState(n, s, share) for n, s in keys.items()]
        self.admin_token, self.max_feedback = admin_token, math.ceil(max_concurrent_feedback * share)
        self.feedback_in_flight = 0
        self._lock = threading.Lock()

    def identify(self, authorization: str | None) -> KeyState | str:
        """The caller's key, "admin" for the admin token, or raise APIError 401/403."""
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise APIError(401, "missing API key: send Authorization: Bearer <key>", "authorization",
                           {"WWW-Authenticate": "Bearer"})
        given_b = given.strip().encode()
        found = None
        for k in self.keys:  # every key compared, in constant time each
            if hmac.compare_digest(given_b, k.spec.key.encode()):
                found = k
        if found is None and self.admin_token and hmac.compare_digest(given_b, self.admin_token.encode()):
            return "admin"
        if found is None:
            raise APIError(403, "unknown API key", "authorization")
        return found

    def admit(self, key: KeyState) -> None:
        """Count a request against its key (rate, concurrency) or raise a 429."""
        with self._lock:
            if key.max_concurrent and key.in_flight >= key.max_concurrent:
                raise limited(f"API key {key.name!r}: {key.in_flight} requests in flight (max_concurrent="
                               f"{key.spec.max_concurrent}{_per_process(key.max_concurrent, key.spec.max_concurrent)})",
                              1.0)
            wait = key.requests.take(1) if key.requests else 0.0
            if wait:
                raise limited(f"API key {key.name!r}: over {key.spec.requests_per_s:g} requests/s", wait)
            key.in_flight += 1

    def release(self, key: KeyState) -> None:
        with self._lock:
            key.in_flight -= 1

    def take_feedback(self) -> bool:
        """Count a feedback call in flight; False (nothing counted) at server.max_concurrent_feedback."""
        with self._lock:
            if self.max_feedback and self.feedback_in_flight >= self.max_feedback:
                return False
            self.feedback_in_flight += 1
            return True

    def give_feedback(self) -> None:
        with self._lock:
            self.feedback_in_flight -= 1


def _per_process(mine: int, whole: int) -> str:
    return f", {mine} in this API process" if mine != whole else ""


def limited(message: str, wait_s: float) -> APIError:
    """A 429 APIError with Retry-After: `wait_s` rounded up to whole seconds (at least 1)."""
    return APIError(429, message + "; retry later", None, {"Retry-After": str(max(1, math.ceil(wait_s)))})


def charge_tokens(num_tokens: int) -> None:
    """Charge prompt + max_tokens of a request to the current key's token rate (429 if over)."""
    key = current_key.get()
    if key is None or key.tokens is None:
        return
    if num_tokens > key.tokens.capacity:
        raise APIError(413, f"max_tokens: the request needs {num_tokens} tokens (prompt + max_tokens), more than API "
                            f"key {key.name!r} may use at once ({key.tokens.capacity:g})", "max_tokens")
    wait = key.tokens.take(num_tokens)
    if wait:
        raise limited(f"API key {key.name!r}: over {key.spec.tokens_per_s:g} tokens/s", wait)


__all__ = ["Quotas", "charge_tokens", "current_key", "limited", "load_keys"]
