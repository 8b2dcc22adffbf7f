"""Model references: a local folder, or a Hugging Face repo id (`org/name`, `org/name@revision`).

    path = resolve_model("JetLM/SDAR-1.7B-Chat")          # -> the snapshot folder in the HF cache
    path = resolve_model("runs/tiny-sft")                  # a folder stays a folder
    served_name("JetLM/SDAR-1.7B-Chat@v1")                 # -> "SDAR-1.7B-Chat" (the name servers report)

A repo id is resolved through `huggingface_hub.snapshot_download` with its usual cache
(`HF_HOME`, `HF_HUB_CACHE`), offline mode (`HF_HUB_OFFLINE=1`: the cache only) and token
(`HF_TOKEN` or `huggingface-cli login`); the files and the revision used are logged.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

log = logging.getLogger("dlrl.hub")
DEFAULT_MODEL_NAME = "dlrl-tiny"  # the name the embedded default is served under
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+(@[\w.\-/]+)?$")
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


class ModelNotFound(ValueError):
    """Neither a folder nor a resolvable hub repo id; the message says which was tried."""


def is_repo_id(ref: str) -> bool:
    """`org/name` or `org/name@rev` that is not an existing path (a folder always wins)."""
    return bool(ref) and not Path(ref).exists() and bool(_REPO_ID.match(ref)) and not ref.startswith((".", "/"))


def model_problem(ref: str, key: str) -> str:
    """"" for "" (the embedded default), an existing folder, or a hub repo id; else a message naming
    `key` (a check the CLIs run before loading anything, dlrl_config.cli)."""
    if not ref or Path(ref).is_dir() or is_repo_id(ref):
        return ""
    if Path(ref).exists():
        return f"{key}: {ref!r} is not a directory (a Hugging Face model folder or a hub repo id org/name)"
    return f"{key}: {ref!r} does not exist (a Hugging Face model folder or a hub repo id org/name[@revision])"


def split_revision(ref: str) -> tuple[str, str | None]:
    repo, _, rev = ref.partition("@")
    return repo, rev or None


def served_name(model: str, served_model_name: str = "") -> str:
    """The model name a server reports (/health, /v1/models) for `server.model=model` (the
    folder's name, a repo id's name; the embedded default is served from runs/tiny-sft: "tiny-sft";
    a `dlrl train` export, runs/tiny-rl/final, is named after its run: "tiny-rl", `export_info`)."""
    if served_model_name:
        return served_model_name
    if not model:
        return DEFAULT_MODEL_NAME
    if is_repo_id(str(model)):
        return Path(split_revision(str(model))[0]).name
    return str(export_info(model).get("name") or "") or Path(str(model)).name


EXPORT_INFO = "dlrl_version.json"  # written into `dlrl train`'s export: {"name", "run_id", "version"}
_NAME = re.compile(r"^[\w.\-]{1,128}$")


def export_info(folder: str | Path) -> dict[str, object]:
    """What `dlrl train` wrote into its export folder (the run's name, its run id, the weight version);
    {} for any other folder (or an unreadable / malformed file; a name must be 1-128 of [A-Za-z0-9_.-])."""
    try:
        info = json.loads((Path(folder) / EXPORT_INFO).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(info, dict):
        return {}
    if not (isinstance(info.get("name"), str) and _NAME.match(info["name"])):
        info.pop("name", None)
    return info


def cached_config(ref: str) -> Path | None:
    """The config.json of `ref` without downloading anything: the folder's own, or the Hugging Face
    cache's for a repo id (None when it is not there yet)."""
    if Path(ref).is_dir():
        path = Path(ref) / "config.json"
        return path if path.is_file() else None
    if not is_repo_id(ref):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return None
    repo, revision = split_revision(ref)
    found = try_to_load_from_cache(repo, "config.json", revision=revision)
    return Path(found) if isinstance(found, str) else None


def resolve_model(ref: str | Path, key: str = "model") -> Path:
    """A local folder for `ref`: the folder itself, or the hub snapshot of a repo id. `key`
    names the config key in errors."""
    ref = str(ref)
    if Path(ref).is_dir():
        return Path(ref)
    if not is_repo_id(ref):
        raise ModelNotFound(f"{key}: {ref!r} is not a directory (nor a Hugging Face repo id org/name[@revision])")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled
    except ImportError as e:  # pragma: no cover - huggingface_hub comes with transformers
        raise ModelNotFound(f"{key}: {ref!r} looks like a hub repo id but huggingface_hub is missing: {e}") from None
    repo, revision = split_revision(ref)
    try:
        try:
            path = Path(snapshot_download(repo, revision=revision, allow_patterns=WEIGHT_PATTERNS))
        except OfflineModeIsEnabled:  # huggingface_hub 1.x, offline, a commit revision: it asks the API first
            path = Path(snapshot_download(repo, revision=revision, allow_patterns=WEIGHT_PATTERNS,
                                          local_files_only=True))
    except LocalEntryNotFoundError as e:
        raise ModelNotFound(f"{key}: {ref!r} is not a directory, and the Hugging Face cache has no snapshot of it "
                            f"(offline: HF_HUB_OFFLINE=1, or no network): {e}") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelNotFound(f"{key}: {ref!r} is not a directory, and as a Hugging Face repo id it could not be "
                            f"fetched: {type(e).__name__}: {e}") from None
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    log.info("%s: %s resolved to %s (revision %s): %s", key, ref, path, path.name, ", ".join(files))
    return path
