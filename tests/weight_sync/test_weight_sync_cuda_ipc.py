"""The cuda_ipc transport and its device-side checksum (mlh64), against a real `dlrl serve` process.

    .venv/bin/python -m pytest -q tests/weight_sync/test_weight_sync_cuda_ipc.py       # CPU kind
    .venv/bin/python -m pytest -q -m gpu tests/weight_sync/test_weight_sync_cuda_ipc.py  # + real CUDA IPC

- mlh64 (weight_sync/devhash.py) equals its pure-Python definition on small inputs (aligned,
  unaligned, across chunk boundaries), every single-bit change moves it, the NaN/inf scan
  names the tensors;
- the manifest names its checksum algorithm (xxh3_64 default, mlh64), anything else is an
  error naming `manifest.checksum_algo`;
- a server subprocess (CPU, lease 2 s) opens the trainer's region by handle (the CPU kind:
  torch's cross-process shared storage) and applies pushes whose digest equals the
  trainer's; the region is shared once and reused; hostile options are 400s naming the
  option; corrupted bytes (checksum mismatch), NaN, an abort, a lapsed lease and another
  run's commit/abort all leave the served weights and version unchanged; a gone sender's
  region is unmapped by the server (/proc/<pid>/maps of its engine core);
- `gpu`: the same push through a real CUDA IPC handle into a CUDA server process.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.helpers import ServerProcess, admin_get, engine_core_pid, start_sync_server
from weight_sync import ManifestError, WeightSender, WeightSyncError, weights_digest
from weight_sync.bucket import pack_stream, pieces, plan_buckets, specs_of
from weight_sync.devhash import CHUNK_WORDS, device_scan, mlh64, mlh64_reference
from weight_sync.manifest import Manifest
from weight_sync.transports.cuda_ipc import IpcReader, IpcRegion

TOKEN = "ipc-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LEASE_S = 2.0
CPU = torch.device("cpu")


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


# ---------------------------------------------------------------------- the checksum
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 63, 64, 1000, 4 * CHUNK_WORDS - 1, 4 * CHUNK_WORDS,
                               4 * CHUNK_WORDS + 13, 8 * CHUNK_WORDS + 4])
def test_mlh64_equals_its_python_definition(n):
    data = os.urandom(n)
    assert mlh64(as_tensor(data)) == mlh64_reference(data)


def test_mlh64_of_an_unaligned_view_and_on_every_device():
    data = os.urandom(5000)
    big = as_tensor(b"xyz" + data)
    assert mlh64(big[3:]) == mlh64_reference(data)  # not 8-byte aligned: the zero-padded copy path
    if torch.cuda.is_available():
        assert mlh64(as_tensor(data).cuda()) == mlh64_reference(data)


def test_mlh64_moves_with_every_bit_and_with_the_length():
    data = bytearray(os.urandom(40))
    base = mlh64(as_tensor(bytes(data)))
    seen = {base}
    for i in range(len(data)):
        for bit in range(8):
            data[i] ^= 1 << bit
            seen.add(mlh64(as_tensor(bytes(data))))
            data[i] ^= 1 << bit
    assert len(seen) == 1 + 8 * len(data)
    assert mlh64(as_tensor(b"\0")) != mlh64(as_tensor(b"\0\0"))
    swapped = bytes(data[8:16] + data[:8] + data[16:])  # the same words in another order
    assert mlh64(as_tensor(swapped)) != base


def test_device_scan_hashes_and_names_nonfinite_tensors():
    named = {"a": torch.randn(100, dtype=torch.bfloat16), "b": torch.randn(7), "c": torch.arange(5)}
    named["a"][17] = float("nan")
    named["b"][3] = float("inf")
    m = plan_buckets(specs_of(named.items()), 1 << 20, 1, "mlh64")
    buf = torch.empty(m.buckets[0].nbytes, dtype=torch.uint8)
    [(_, _, crc)] = list(pack_stream(m, iter(named.items()), lambda i, n: buf))
    digest, bad = device_scan(buf, pieces(m, 0), check_finite=True)
    assert digest == crc == mlh64_reference(buf.numpy().tobytes())
    assert bad == ["a", "b"]
    assert device_scan(buf, pieces(m, 0), check_finite=False) == (digest, [])


def test_the_manifest_names_its_checksum_algorithm():
    named = {"w": torch.ones(3)}
    m = plan_buckets(specs_of(named.items()), 1 << 10, 1)
    assert m.checksum_algo == "xxh3_64" and Manifest.from_json(m.to_json()).checksum_algo == "xxh3_64"
    d = plan_buckets(specs_of(named.items()), 1 << 10, 1, "mlh64").to_dict()
    assert Manifest.from_dict(d).checksum_algo == "mlh64"
    legacy = {k: v for k, v in d.items() if k != "checksum_algo"}
    assert Manifest.from_dict(legacy).checksum_algo == "xxh3_64"  # manifests without the field stay valid
    with pytest.raises(ManifestError, match=r"manifest\.checksum_algo: unsupported 'md5'"):
        Manifest.from_dict({**d, "checksum_algo": "md5"})


# ---------------------------------------------------------------------- options (no server)
@pytest.fixture
def region_options() -> Iterator[tuple[dict, Manifest]]:
    named = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    m = plan_buckets(specs_of(named.items()), 1 << 12, 1, "mlh64")
    region = IpcRegion("opts", allow_cpu=True)
    try:
        yield region.prepare(m, CPU), m
    finally:
        region.close()


@pytest.mark.parametrize(("change", "field"), [
    ({"kind": "gpu"}, r"options\.kind: expected one of"),
    ({"kind": "cuda"}, r"options\.kind: a 'cuda' region, but this server's model is on cpu"),
    ({"handle": "%%% not base64"}, r"options\.handle: not valid base64"),
    ({"handle": base64.b64encode(b"/etc/passwd").decode()}, r"options\.handle: not a torch shared-memory file"),
    ({"handle": base64.b64encode(b"/torch_1_2_3").decode()}, r"options\.handle: shared file .* does not exist"),
    ({"handle": 5}, r"options\.handle: expected a base64 string"),
    ({"manager": base64.b64encode(b"/tmp/x/manager.sock").decode()}, r"options\.manager"),
    ({"size": 1 << 40}, r"options\.size: 1099511627776 bytes, but the shared file has"),
    ({"size": -1}, r"options\.size: expected an integer >= 1"),
    ({"offsets": [3]}, r"options\.offsets"),
    ({"offsets": [0, 1 << 30]}, r"options\.offsets\[1\]: bucket of"),
    ({"header": "/etc/passwd"}, r"options\.header: .* is not a weight-sync region"),
    ({"header": "dlrl_ws_gone_1_x"}, r"options\.header: .* does not exist"),
])
def test_hostile_options_are_refused_naming_the_field(region_options, change, field):
    opts, m = region_options
    IpcReader.check(opts, m, CPU)  # the real options pass
    bad = {**opts, **change}
    if change.get("offsets") == [0, 1 << 30]:
        bad["offsets"] = [opts["offsets"][0], 1 << 30]
    with pytest.raises(ManifestError, match=field):
        IpcReader.check(bad, m, CPU)


def test_sender_refuses_cpu_weights_unless_the_cpu_kind_is_allowed():
    sender = WeightSender(["http://127.0.0.1:9"], transport="cuda_ipc", token=TOKEN)
    try:
        with pytest.raises(WeightSyncError, match=r"on cpu, not on CUDA.*sync_ipc_allow_cpu"):
            sender.connect({"w": torch.ones(4)}.items())
    finally:
        sender.close()


def test_trainer_accepts_cuda_ipc_and_fails_early_on_cpu():
    from trainer.config import TrainConfig
    from trainer.run import check_sync_device

    assert TrainConfig(sync_transport="cuda_ipc").sync_transport == "cuda_ipc"
    with pytest.raises(ValueError, match=r"train\.sync_transport: cuda_ipc shares GPU memory.*sync_ipc_allow_cpu"):
        check_sync_device("cuda_ipc", allow_cpu=False, on_cuda=False)
    check_sync_device("cuda_ipc", allow_cpu=True, on_cuda=False)
    check_sync_device("cuda_ipc", allow_cpu=False, on_cuda=True)
    check_sync_device("shm", allow_cpu=False, on_cuda=False)


# ---------------------------------------------------------------------- a real server process
@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with start_sync_server(tiny_model_dir, TOKEN, tmp_path_factory.mktemp("ipc"), LEASE_S) as srv:
        yield srv


get = partial(admin_get, token=TOKEN)  # an admin GET that must answer 200 -> its JSON


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60)


def model_weights(model_dir: str, shift: float = 0.0) -> dict[str, torch.Tensor]:
    from dllm.weights import load_pretrained

    return {n: t.detach() + shift for n, t in load_pretrained(model_dir).hf_named_tensors()}


class RawPush:
    """One cuda_ipc update driven by hand (CPU kind): begin, pack (optionally corrupting), commit/abort."""

    def __init__(self, server, named: dict[str, torch.Tensor], version: int, run_id: str):
        self.url, self.named, self.version, self.run_id = server.url, named, version, run_id
        self.region = IpcRegion(run_id, allow_cpu=True)
        self.manifest = plan_buckets(specs_of(named.items()), 1 << 16, version, "mlh64")
        self.options = self.base = self.region.prepare(self.manifest, CPU)

    def begin(self) -> httpx.Response:
        self.region.clear_ready()
        return post(self.url, "/weights/begin", {"version": self.version, "transport": "cuda_ipc",
                                                 "manifest": self.manifest.to_dict(), "options": self.options,
                                                 "run_id": self.run_id})

    def pack(self, corrupt_bucket: int | None = None, upto: int | None = None) -> list[int]:
        crcs = []
        for index, buf, crc in pack_stream(self.manifest, iter(self.named.items()), self.region.bucket,
                                           self.region.beat):
            if index == corrupt_bucket:
                buf[100] = buf[100] ^ 1  # after the sender's checksum: the bytes the server reads differ
            self.region.mark_ready(index, self.version)
            crcs.append(crc)
            if upto is not None and index + 1 >= upto:
                break
        return crcs

    def commit(self, crcs: list[int], run_id: str | None = None) -> httpx.Response:
        return post(self.url, "/weights/commit", {"version": self.version, "checksums": crcs,
                                                  "run_id": self.run_id if run_id is None else run_id})

    def close(self) -> None:
        self.region.close()

    def __enter__(self) -> RawPush:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unchanged(server, before: dict) -> None:
    assert get(server.url, "/weights/checksum") == before
    status = get(server.url, "/weights/version")
    assert status["update"] is None and status["version"] == before["version"]


def test_push_end_to_end_reuses_one_shared_region(server: ServerProcess):
    sender = WeightSender([server.url], transport="cuda_ipc", token=TOKEN, run_id="run-ipc", bucket_bytes=1 << 16,
                          ipc_allow_cpu=True, timeout=60)
    try:
        sender.connect(model_weights(server.model_dir).items())
        assert sender.ipc is not None
        handle = dict(sender.ipc.handle)
        assert handle["kind"] == "cpu"
        for step in (1, 2):
            v = get(server.url, "/weights/version")["version"] + 1
            named = model_weights(server.model_dir, 0.01 * v)
            timings = sender.push(named.items(), v)
            assert timings["num_buckets"] > 1 and timings["connect_s"] == 0.0, step  # shared once, at connect
            assert get(server.url, "/weights/checksum") == {"version": v, "digest": weights_digest(named)}
            assert get(server.url, f"/weights/updates/{v}")["state"] == "applied"
        assert sender.ipc.handle == handle  # the same region, not re-shared
    finally:
        sender.close()
    r = httpx.post(server.url + "/generate", json={"prompt": "1+2=", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["version"] == v, r.text


def test_the_trainers_fleet_pushes_over_cuda_ipc(server):
    from trainer.infra.fleet import ServerFleet

    fleet = ServerFleet([server.url], TOKEN, sync_options={"transport": "cuda_ipc", "ipc_allow_cpu": True,
                                                           "run_id": "run-fleet", "timeout": 60})
    try:
        v = get(server.url, "/weights/version")["version"] + 1
        named = model_weights(server.model_dir, 0.05 * v)
        fleet.connect(named.items())
        fleet.push(named.items(), v)
        assert fleet.digests() == {server.url: weights_digest(named)}
    finally:
        fleet.close()


def test_hostile_options_over_http_are_400_naming_the_field(server):
    before = get(server.url, "/weights/checksum")
    with RawPush(server, model_weights(server.model_dir), before["version"] + 1, "run-hostile") as push:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"kind": "cuda"}, "options.kind"), ({"handle": "!!"}, "options.handle"),
            ({"size": 1 << 40}, "options.size"), ({"header": "nope"}, "options.header")]
        for change, field in cases:
            push.options = {**push.base, **change}
            r = push.begin()
            assert r.status_code == 400 and field in r.text, r.text
    unchanged(server, before)


def test_corrupted_bytes_are_detected_and_nothing_changes(server):
    before = get(server.url, "/weights/checksum")
    with RawPush(server, model_weights(server.model_dir, 0.5), before["version"] + 1, "run-corrupt") as push:
        assert push.begin().status_code == 200
        r = push.commit(push.pack(corrupt_bucket=1))
        assert r.status_code == 400 and "checksum mismatch in bucket(s) [1]" in r.text, r.text
    unchanged(server, before)


def test_nan_is_refused_and_nothing_changes(server):
    before = get(server.url, "/weights/checksum")
    named = model_weights(server.model_dir, 0.3)
    named["model.norm.weight"][3] = float("nan")
    with pytest.raises(WeightSyncError, match=r"HTTP 400.*non-finite.*model\.norm\.weight"):
        from weight_sync import push

        push([server.url], named.items(), before["version"] + 1, transport="cuda_ipc", token=TOKEN,
             bucket_bytes=1 << 16, ipc_allow_cpu=True, timeout=60)
    unchanged(server, before)


def test_another_run_can_neither_commit_nor_abort(server):
    before = get(server.url, "/weights/checksum")
    named = model_weights(server.model_dir, 0.07)
    with RawPush(server, named, before["version"] + 1, "run-a") as push:
        assert push.begin().status_code == 200
        crcs = push.pack()
        r = push.commit(crcs, run_id="run-b")
        assert r.status_code == 409 and "belongs to run 'run-a'" in r.text, r.text
        r = post(server.url, "/weights/abort", {"version": push.version, "run_id": "run-b"})
        assert r.status_code == 409 and "belongs to run 'run-a'" in r.text, r.text
        assert get(server.url, "/weights/checksum") == before
        r = push.commit(crcs)  # the owner's commit still goes through
        assert r.status_code == 200 and r.json()["state"] == "applied", r.text
    assert get(server.url, "/weights/checksum") == {"version": push.version, "digest": weights_digest(named)}


def test_abort_leaves_weights_and_version(server):
    before = get(server.url, "/weights/checksum")
    with RawPush(server, model_weights(server.model_dir, 0.2), before["version"] + 1, "run-abort") as push:
        assert push.begin().status_code == 200
        push.pack(upto=1)
        r = post(server.url, "/weights/abort", {"version": push.version, "run_id": "run-abort"})
        assert r.status_code == 200 and r.json()["aborted"] is True, r.text
        r = push.commit(push.pack())
        assert r.status_code == 409, r.text  # no update any more
    unchanged(server, before)
    assert get(server.url, f"/weights/updates/{push.version}")["state"] == "failed"


def maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_a_gone_senders_region_is_unmapped_by_the_server(server):
    before = get(server.url, "/weights/checksum")
    with RawPush(server, model_weights(server.model_dir, 0.4), before["version"] + 1, "run-gone") as push:
        name = base64.b64decode(push.options["handle"]).decode()
        assert push.begin().status_code == 200
        push.pack(upto=1)
        assert name in maps(engine_core_pid(server.url))  # the server's engine core maps the trainer's region
    # the sender is gone: its header unlinked, its storage freed on its side
    r = post(server.url, "/weights/abort", {"version": push.version, "run_id": "run-gone"})
    assert r.status_code == 200 and r.json()["aborted"] is True, r.text
    deadline = time.monotonic() + 10
    while name in maps(engine_core_pid(server.url)):
        assert time.monotonic() < deadline, "the server still maps a gone sender's region"
        time.sleep(0.2)
    unchanged(server, before)


def test_the_heartbeat_holds_the_lease_and_silence_loses_it(server):
    before = get(server.url, "/weights/checksum")
    with RawPush(server, model_weights(server.model_dir, 0.9), before["version"] + 1, "run-lease") as push:
        assert push.begin().status_code == 200
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2 * LEASE_S:  # beating: alive past the lease
            push.region.beat()
            time.sleep(0.2)
        assert get(server.url, "/weights/version")["update"]["phase"] == "receiving"
        time.sleep(LEASE_S + 1.5)  # silent: dropped
        status = get(server.url, "/weights/version")
        assert status["update"] is None and "lease expired: no data from run 'run-lease'" in status["last_failure"]
        assert push.commit(push.pack()).status_code == 409
    unchanged(server, before)


# ---------------------------------------------------------------------- real CUDA IPC
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_push_through_real_cuda_ipc(tiny_model_dir, tmp_path):
    proc = start_sync_server(tiny_model_dir, TOKEN, tmp_path, LEASE_S, "server.device=cuda", "server.dtype=bfloat16",
                             cpu_only=False)
    try:
        sender = WeightSender([proc.url], transport="cuda_ipc", token=TOKEN, run_id="run-gpu",
                              bucket_bytes=1 << 16, dtype="auto", timeout=120)
        try:
            for v in (1, 2):
                named = {n: t.cuda() for n, t in model_weights(tiny_model_dir, 0.01 * v).items()}
                sender.push(named.items(), v)
                assert sender.ipc is not None and sender.ipc.handle["kind"] == "cuda"
                sent = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in named.items()}
                assert get(proc.url, "/weights/checksum") == {"version": v, "digest": weights_digest(sent)}
            named["model.norm.weight"][0] = float("nan")
            with pytest.raises(WeightSyncError, match="non-finite"):
                sender.push(named.items(), 3)
            assert get(proc.url, "/weights/version")["version"] == 2
        finally:
            sender.close()
        r = httpx.post(proc.url + "/generate", json={"prompt": "1+2=", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["version"] == 2, r.text
    finally:
        proc.stop()
