"""The import contracts of docs/DESIGN.md, enforced: which package may import which, the torch-free
modules, where the heavy libraries may be imported. Reads the sources with `ast` (nothing is
imported); a failure names the file, the line and the import.

    python -m pytest -q tests/dlrl/test_import_contracts.py      # part of `make test-fast`

Every import counts, a lazy one inside a function too (a lazy import still makes the arrow);
`dlrl` (the command) reaches the packages through importlib, by name, and is held to importing
only dlrl_config at its top level.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dlrl", "dlrl_config", "dllm", "server", "trainer", "weight_sync", "rollout_client", "store")

# package -> the sibling packages it may import (docs/DESIGN.md, "Packages and import direction")
MAY_IMPORT: dict[str, set[str]] = {
    "dlrl_config": set(),
    "store": set(),
    "weight_sync": set(),
    "dllm": {"dlrl_config"},
    "rollout_client": {"dllm"},
    "server": {"dllm", "dlrl_config", "weight_sync", "rollout_client", "store"},
    "trainer": {"dllm", "dlrl_config", "weight_sync", "rollout_client", "store"},
    "dlrl": {"dlrl_config"},
}
# the wire and the decoder share these dllm modules; they import neither torch nor a dllm module
# outside this set, so rollout_client stays torch-free
TORCH_FREE_DLLM = {"dllm.trace", "dllm.strategy", "dllm.ranges", "dllm.errors", "dllm.options",
                   "dllm.logit_bias_rules"}
# heavy or optional libraries -> the packages that may import them (lazily or not)
HEAVY: dict[str, set[str]] = {
    "deepspeed": {"trainer", "weight_sync"},  # weight_sync.sources gathers ZeRO-3 shards
    "fastapi": {"server"}, "starlette": {"server"}, "uvicorn": {"server"}, "zmq": {"server"}, "msgspec": {"server"},
    "datasets": {"trainer"}, "pyarrow": {"trainer"}, "wandb": {"trainer"}, "mlflow": {"trainer"},
    "trackio": {"trainer"}, "matplotlib": {"trainer"}, "math_verify": {"trainer"}, "sympy": {"trainer"},
    "psycopg": {"store"}, "psycopg_pool": {"store"},
    "torch": {"dllm", "server", "trainer", "weight_sync"},
}


def _imports(path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line, module, at top level) of every absolute import in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, id(node) in top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module, id(node) in top


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _where(path: Path, line: int, module: str) -> str:
    return f"{path.relative_to(ROOT)}:{line}: import {module}"


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_only_what_design_allows(package: str) -> None:
    bad = []
    for path in _files(package):
        for line, module, at_top in _imports(path):
            top = module.split(".")[0]
            if top in PACKAGES and top != package and top not in MAY_IMPORT[package]:
                bad.append(f"{_where(path, line, module)}  ({package} never imports {top})")
            if package == "dlrl" and at_top and top in PACKAGES and top not in MAY_IMPORT["dlrl"]:
                bad.append(f"{_where(path, line, module)}  (the dlrl command imports packages lazily)")
    assert not bad, "imports against docs/DESIGN.md:\n" + "\n".join(bad)


def test_heavy_libraries_stay_in_the_packages_that_need_them() -> None:
    bad = []
    for package in PACKAGES:
        for path in _files(package):
            for line, module, _ in _imports(path):
                allowed = HEAVY.get(module.split(".")[0])
                if allowed is not None and package not in allowed:
                    bad.append(f"{_where(path, line, module)}  (only {', '.join(sorted(allowed))} may import it)")
    assert not bad, "heavy imports outside their packages:\n" + "\n".join(bad)


def test_the_wire_is_torch_free() -> None:
    """rollout_client imports only dllm's torch-free contract modules, and they import no torch."""
    bad = []
    for path in _files("rollout_client"):
        for line, module, _ in _imports(path):
            if module.split(".")[0] == "dllm" and module not in TORCH_FREE_DLLM:
                bad.append(f"{_where(path, line, module)}  (rollout_client imports only {sorted(TORCH_FREE_DLLM)})")
    for name in sorted(TORCH_FREE_DLLM):
        path = ROOT / (name.replace(".", "/") + ".py")
        for line, module, _ in _imports(path):
            if module.split(".")[0] == "torch" or (module.startswith("dllm") and module not in TORCH_FREE_DLLM):
                bad.append(f"{_where(path, line, module)}  ({name} is torch-free)")
    assert not bad, "\n".join(bad)


def test_nothing_in_dllm_imports_its_embedded_default() -> None:
    bad = [_where(path, line, module) for path in _files("dllm") if "embedded" not in path.parts
           for line, module, _ in _imports(path) if module.startswith("dllm.embedded")]
    assert not bad, "dllm/ imports dllm.embedded (docs/DESIGN.md: nothing in dllm/ imports it):\n" + "\n".join(bad)


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The rules bite: an upward import is found and named with its line."""
    f = tmp_path / "x.py"
    f.write_text("import os\n\ndef lazy():\n    from server.api.app import build_app\n")
    assert list(_imports(f)) == [(1, "os", True), (4, "server.api.app", False)]
