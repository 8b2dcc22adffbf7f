"""Sender-side unit tests: tensor sources (plain, callable, ZeRO-3 gather), argument checks, abort on failure.

    .venv/bin/python -m pytest -q tests/weight_sync/test_weight_sync_sender.py
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.helpers import fake_zero3_gather
from tests.weight_sync.test_weight_sync_transports import (
    FakeEngine,
    FakeModel,
    ReceiverServer,
    make,
    make_app,
)
from weight_sync import WeightSender, WeightSyncError, weights_digest
from weight_sync.sources import as_source, drain, iter_deepspeed_params


def test_as_source_plain_dict_and_dtype_cast():
    named = make(1)
    src = as_source(named, torch.bfloat16)
    assert [s[0] for s in src.specs] == list(named)
    assert {s[1] for s in src.specs} == {"bfloat16"}
    assert [n for n, _ in src.make_iter()] == list(named)
    assert [n for n, _ in src.make_iter()] == list(named)  # re-iterable (generator inputs are materialised)
    gen = as_source(iter(named.items()), None)
    assert len(list(gen.make_iter())) == len(named) == len(list(gen.make_iter()))


def test_as_source_callable_without_specs_is_called_twice():
    calls = []

    def source():
        calls.append(1)
        yield from make(1).items()

    src = as_source(source, None)
    assert len(calls) == 1 and src.specs[0] == ("embed.weight", "float32", (64, 32))
    assert len(list(src.make_iter())) == 5 and len(calls) == 2


def test_deepspeed_source_gathers_partitioned_groups(monkeypatch):
    model = FakeModel(make(1))
    norm = model.norm.weight
    norm.ds_id, norm.ds_shape = 7, norm.shape  # pretend norm.weight is a ZeRO-3 partitioned param
    gathered = fake_zero3_gather(monkeypatch)
    engine = types.SimpleNamespace(module=model)
    source = iter_deepspeed_params(engine, gather_bytes=4096)
    specs = source.specs(torch.float32)
    assert [s[0] for s in specs] == [n for n, _ in model.named_parameters()]
    assert {s[1] for s in specs} == {"float32"}  # bf16 params are cast to the requested dtype
    out = dict(source())
    assert gathered == [[id(norm)]]  # only the group holding the partitioned param is gathered
    assert weights_digest(out) == weights_digest(model.named_parameters())
    drain(source)
    assert len(gathered) == 2


def test_sender_argument_checks():
    with pytest.raises(ValueError, match="transport"):
        WeightSender(["http://x"], transport="pigeon")
    with pytest.raises(ValueError, match="servers"):
        WeightSender([], transport="http")


def test_unreachable_server_raises_weight_sync_error():
    sender = WeightSender(["http://127.0.0.1:9"], transport="http", token="t", timeout=2)
    with pytest.raises(WeightSyncError, match="push of version 1 \\(http\\) failed"):
        sender.push(make(1), 1)
    sender.close()


@pytest.mark.parametrize("transport, fail_at", [("http", 3), ("shm", 3), ("http", 0), ("dist", 0)])
def test_source_failure_aborts_the_update(transport, fail_at):
    """A source failing mid-push, or before its first bucket is complete, aborts the begun update."""
    engine = FakeEngine(FakeModel(make(0)))
    with ReceiverServer(make_app(engine)) as srv:
        before = srv.get("/weights/checksum")
        calls = []

        def bad_source():
            calls.append(1)
            for k, (n, t) in enumerate(make(1).items()):
                if k == fail_at and len(calls) == 2:
                    raise RuntimeError("gather failed")
                yield n, t

        sender = WeightSender([srv.url], transport=transport, token="test-token", bucket_bytes=4096)
        with pytest.raises(WeightSyncError, match="gather failed"):
            sender.push(bad_source, 1)
        status = srv.get("/weights/version")
        assert status["update"] is None and "sender failed" in status["last_failure"]
        assert srv.get("/weights/checksum") == before
        timings = sender.push(make(1), 1)  # the same sender recovers
        assert timings["version"] == 1 and srv.get("/weights/checksum")["digest"] == weights_digest(make(1))
        sender.close()


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_a_stop_signal_mid_push_aborts_the_update_and_propagates_unwrapped(transport):
    """The trainer's SIGTERM handler raises StopRequested inside a push in flight: the update is aborted
    and the exception reaches the trainer as it is (a WeightSyncError would make it exit 1, not
    checkpoint and exit 0)."""
    from trainer.loop import StopRequested

    engine = FakeEngine(FakeModel(make(0)))
    with ReceiverServer(make_app(engine)) as srv:
        before = srv.get("/weights/checksum")

        calls = []

        def interrupted():  # the first call only lists the tensors (as_source); the second is the push
            calls.append(1)
            for k, (n, t) in enumerate(make(1).items()):
                if k == 2 and len(calls) == 2:
                    raise StopRequested("SIGTERM during a push: aborting it")
                yield n, t

        sender = WeightSender([srv.url], transport=transport, token="test-token", bucket_bytes=4096)
        with pytest.raises(StopRequested):
            sender.push(interrupted, 1)
        status = srv.get("/weights/version")
        assert status["update"] is None and "sender failed" in status["last_failure"]
        assert srv.get("/weights/checksum") == before
        sender.close()
