"""What the servers hold, checked against what `dlrl eval` was asked to evaluate.

    served = check_served(fleet, model="runs/tiny-sft", verify="checksum", started=[...])
    served  -> {url: {"model": "tiny-sft", "version": 0, "checksum": "3f..", "started": False}}

Every server's model name (/health), weight version and checksum (GET /weights/version and
/weights/checksum, admin token) are read and recorded in results.json. With `eval.model` set,
`verify=checksum` compares the served checksum with the digest of the model folder's weights in
the served dtype (`weight_sync.weights_digest`, as the trainer does); `verify=name` compares the
names only (no token needed); a mismatch is an `EvalMismatch` naming both. Servers eval started
itself (`started`) hold the folder by construction and are not re-checked. Without `eval.model`
eval evaluates whatever is served, and says so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dllm.hub import served_name
from dllm.weights import load_pretrained, parse_dtype
from rollout_client.client import AdminError
from weight_sync import weights_digest

if TYPE_CHECKING:
    from trainer.infra.fleet import ServerFleet

log = logging.getLogger("dlrl.eval")


class EvalMismatch(RuntimeError):
    """A server holds other weights than the model eval was asked for."""


def folder_digest(model_dir: str | Path, dtype: str | None) -> str:
    """Digest of a model folder's weights in the served dtype (what GET /weights/checksum gives)."""
    model = load_pretrained(model_dir, dtype=parse_dtype(dtype) if dtype else None)
    return weights_digest(dict(model.hf_named_tensors()))


def _read(fleet: ServerFleet, url: str) -> dict[str, Any]:
    try:
        version = fleet.admin(url, "GET", "/weights/version")
        digest = fleet.admin(url, "GET", "/weights/checksum")
    except AdminError as e:
        return {"version": None, "checksum": None, "dtype": None, "unverified": str(e)}
    return {"version": int(version["version"]), "checksum": digest["digest"], "dtype": version.get("dtype")}


def check_served(fleet: ServerFleet, model: str, model_dir: Path | None, verify: str, started: list[str],
                 served_model_name: str = "") -> dict[str, dict[str, Any]]:
    """Read and record what each server holds; raise EvalMismatch where it is not `model`."""
    names = fleet.names()
    served: dict[str, dict[str, Any]] = {}
    digests: dict[str | None, str] = {}
    for url in fleet.urls:
        info = {"model": names.get(url), **_read(fleet, url), "started": url in started}
        served[url] = info
        where = (f"{url} serves model {info['model']!r} at weight version {info['version']} "
                 f"(checksum {info['checksum']})")
        if not model or verify == "none" or info["started"]:
            log.info("evaluating what %s", where)
            continue
        want = served_name(model, served_model_name)
        if verify == "name" or info["checksum"] is None:
            if info["checksum"] is None and verify == "checksum":
                raise EvalMismatch(f"eval.verify=checksum: cannot read what {url} holds ({info['unverified']}); "
                                   "give the servers' admin token (eval.admin_token, env DLRL_ADMIN_TOKEN or "
                                   "server.admin_token_file), or set eval.verify=name to compare model names only")
            if info["model"] != want:
                raise EvalMismatch(f"{where}, but eval.model={model} is served as {want!r}: refusing to evaluate "
                                   "another model. Point eval.servers at a server of this model, or set "
                                   "eval.own_server=true to start one")
            continue
        if info["dtype"] not in digests:
            digests[info["dtype"]] = folder_digest(model_dir or model, info["dtype"])
        if info["checksum"] != digests[info["dtype"]]:
            raise EvalMismatch(f"{where}, but eval.model={model} has checksum {digests[info['dtype']]}: the "
                               "server holds other weights (another model, or weights pushed by a trainer). "
                               "Point eval.servers at a server holding this model, or set eval.own_server=true "
                               "to start one")
        log.info("%s: the weights of eval.model=%s", where, model)
    return served
