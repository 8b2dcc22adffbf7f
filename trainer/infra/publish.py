"""Publisher: the job's one voice to the servers' weights.

    pub = Publisher(ranks, fleet, engine, server_wait_s=120)
    pub.start()            # version = the servers' (all must agree); every rank learns it
    pub.ensure_in_sync()   # push if any server holds other weights than the trainer's policy
    pub.check_fleet()      # before rollouts: every server at `pub.version`, restarted ones re-synced
    pub.push()             # version + 1 into every server, in place
    pub.adopt(12)          # a number known elsewhere (the registry, a resumed checkpoint): never reused

`version` (read-only) is the version the trainer last pushed or adopted; only the Publisher
changes it (start, push, adopt). The servers each own the version they serve
(server.engine.engine.Engine); `check_fleet` compares the two.

With `record` (train.record_digests) the digest of every pushed version is appended to
`versions.jsonl` before the push, so any server's `/weights/checksum` can be matched to the
exact trainer weights it holds (an audit trail; costs one hash of the weights per push).

Rank 0 alone uses the control plane (begin / commit / abort / version / checksum); every
rank learns the outcome (the new version, or rank 0's error) through `Ranks.on_main`. Under
ZeRO-3 the parameters feeding a push are gathered collectively: rank 0 announces each pass
over the parameters and the other ranks join it, and a failed push still completes the pass
so no rank is left waiting in a gather.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from dllm.weights import parse_dtype
from trainer.infra.dist import Ranks
from trainer.infra.ds_engine import DSEngine, named_full_params
from trainer.infra.faults import Faults
from trainer.infra.fleet import FleetError, ServerFleet
from weight_sync import drain, iter_deepspeed_params, weights_digest
from weight_sync.bucket import Spec

log = logging.getLogger("dlrl.train")
T = TypeVar("T")


class ParamSource(Protocol):
    """A weight_sync source: called, it yields (name, tensor) pairs; `specs` says their shapes beforehand."""

    device: torch.device

    def specs(self, dtype: torch.dtype | None = None) -> list[Spec]: ...
    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class _Wrapped:
    """A source that passes another's tensors on (`__call__` says how), with its device and specs."""

    def __init__(self, source: ParamSource) -> None:
        self.source, self.device = source, source.device

    def specs(self, dtype: torch.dtype | None = None) -> list[Spec]:
        return self.source.specs(dtype)


class _Announced(_Wrapped):
    """A weight_sync source whose every pass over the parameters the other ranks join."""

    def __init__(self, source: ParamSource, ranks: Ranks) -> None:
        super().__init__(source)
        self.ranks = ranks

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.ranks.announce("gather")
        it = self.source()
        try:
            yield from it
        finally:  # the consumer stopped early (error): finish the collective pass anyway
            for _ in it:
                pass


class _CrashMidPush(_Wrapped):
    """The source, wrapped so that DLRL_FAULT=push:N kills the pusher after its first tensor."""

    def __init__(self, source: ParamSource, faults: Faults) -> None:
        super().__init__(source)
        self.faults = faults

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.source()):
            if i == 1:
                self.faults.crash_at("push")
            yield item


class Publisher:
    def __init__(self, ranks: Ranks, fleet: ServerFleet, engine: DSEngine[nn.Module], *, server_wait_s: float = 120.0,
                 record: Path | None = None, faults: Faults | None = None) -> None:
        self.ranks, self.fleet, self.engine = ranks, fleet, engine
        self.server_wait_s = server_wait_s
        self.record = record  # versions.jsonl: {version, digest} of every push, written before it
        self._version = 0
        self.pushing = False  # rank 0 is inside a push (a stop signal aborts it)
        self.faults = faults or Faults()  # the run's fault hook (DLRL_FAULT=push:N)

    @property
    def version(self) -> int:
        """The version the trainer's policy was last pushed (or adopted) as."""
        return self._version

    def adopt(self, version: int) -> bool:
        """Go on from `version` when it is past ours (a number the registry, a replica or a resumed
        checkpoint knows is never reused); True when the version moved."""
        if version <= self._version:
            return False
        self._version = version
        return True

    # ------------------------------------------------------------------ helpers
    def _source(self) -> ParamSource:
        return iter_deepspeed_params(self.engine)

    def _is_zero3(self) -> bool:
        return any(hasattr(p, "ds_id") for p in self.engine.module.parameters())

    def _collective(self, fn: Callable[[ParamSource], T]) -> T:
        """Run fn(source) on rank 0, the other ranks joining every announced parameter pass."""
        source = self._source()
        shared: ParamSource = _Announced(source, self.ranks) if self._is_zero3() and self.ranks.world_size > 1 else source
        return self.ranks.on_main(lambda: fn(shared), while_waiting=lambda cmd: drain(source))

    # ------------------------------------------------------------------ actions
    def start(self) -> int:
        """Adopt the servers' version (they must all hold the same one)."""
        def read() -> int:
            versions = self.fleet.versions()
            if len(set(versions.values())) > 1:
                log.warning("servers hold different versions %s: the next push brings them together", versions)
            return max(versions.values())
        self._version = self.ranks.on_main(read)
        self.ranks.on_main(lambda: self.fleet.connect(self._source()))  # the first push as fast as the rest
        return self.version

    def push(self, urls: list[str] | None = None, version: int | None = None) -> dict[str, Any]:
        """Push the policy as `version` (default: version + 1) into `urls` (default: all)."""
        new = self.version + 1 if version is None else version
        if self.record is not None:
            digest = self.local_digest()
            if self.ranks.is_main:
                with self.record.open("a") as f:
                    f.write(json.dumps({"version": new, "digest": digest, "time": round(time.time(), 3)}) + "\n")

        def send(source: ParamSource) -> dict[str, Any]:
            src = _CrashMidPush(source, self.faults)
            self.pushing = True
            try:
                return self._push_through_restarts(src, new, list(urls or self.fleet.urls))
            finally:
                self.pushing = False

        stats = self._collective(send)
        self.adopt(new)
        return stats

    def local_digest(self) -> str | None:
        """Digest of the policy in the dtype the servers serve (collective under ZeRO-3)."""
        served = self.ranks.on_main(self.fleet.served_dtype)
        if not (self.ranks.is_main or self._is_zero3()):
            return None
        return weights_digest(named_full_params(self.engine, dtype=parse_dtype(served) if served else None))

    def ensure_in_sync(self) -> bool:
        """Make every server serve exactly the trainer's weights (push if any digest differs)."""
        local = self.local_digest()
        stale = self.ranks.on_main(lambda: [u for u, d in self.fleet.digests().items() if d != local])
        if not stale:
            return False
        if self.ranks.is_main:
            log.info("servers %s hold other weights than the trainer's policy: pushing version %d",
                     ", ".join(stale), self.version + 1)
        self.push()
        return True

    def check_fleet(self) -> None:
        """Before rollouts: every server serves `self.version`. A server that restarted (its
        version went back) gets the policy again; one that is down is waited for up to
        `server_wait_s`, then the run stops with an error naming it."""
        behind = self.ranks.on_main(self._behind)
        if behind and self.ranks.is_main:
            log.warning("servers %s restarted (version behind %d): re-syncing them", ", ".join(behind),
                        self.version)
        if behind:
            self.push(urls=behind, version=self.version)

    def _push_through_restarts(self, src: ParamSource, version: int, urls: list[str]) -> dict[str, Any]:
        """Push; if a server went down meanwhile (unreachable, or back up having forgotten the
        update: it restarted), wait for it (bounded) and push the same version again to the servers
        that do not hold it. Each server applies it whole or not at all."""
        try:
            return self.fleet.push(src, version, urls)
        except FleetError as e:
            if not (e.restarted or self.fleet.unreachable()):
                raise
            log.warning("%s: waiting up to %.0fs for the servers to come back", e, self.server_wait_s)
        versions = self._wait_for_servers(urls)
        missing = [u for u in urls if versions[u] < version]
        if not missing:
            return {}
        log.warning("servers %s are back at version %s (restarted): pushing version %d to them", ", ".join(missing),
                    ", ".join(str(versions[u]) for u in missing), version)
        return self.fleet.push(src, version, missing)

    def _wait_for_servers(self, urls: list[str] | None = None) -> dict[str, int]:
        """Every server's version, once all answer; a server still down after `server_wait_s`
        stops the run with an error naming it."""
        deadline = time.monotonic() + self.server_wait_s
        warned = False
        while True:
            try:
                self.fleet.wait_ready(max(1.0, deadline - time.monotonic()), urls)
                return self.fleet.versions(urls)
            except FleetError:
                down = self.fleet.unreachable()
                if not down:
                    raise  # it answers, with an error: not a restart
                if time.monotonic() > deadline:
                    raise FleetError(f"servers {', '.join(down)} unreachable for {self.server_wait_s:.0f}s "
                                     "(train.server_wait_s): stopping") from None
                if not warned:
                    log.warning("servers %s unreachable: waiting up to %.0fs for them", ", ".join(down),
                                self.server_wait_s)
                    warned = True
                time.sleep(1.0)

    def _behind(self) -> list[str]:
        versions = self._wait_for_servers()
        ahead = {u: v for u, v in versions.items() if v > self.version}
        if ahead:
            raise FleetError(f"servers {ahead} hold a newer version than the trainer's {self.version}: "
                             "another trainer is pushing to them")
        return [u for u, v in versions.items() if v < self.version]
