"""Import a package of this repository as it was at a git ref, side by side with today's (engine comparisons).

    old = load_package("dllm", "49d4c43")      # -> module `dllm_49d4c43`; old.decoding, old.model, ...
    old_model = old.model.SDARForCausalLM(old.config.SDARConfig(**cfg.to_dict()))

The files come from `git show <ref>:<path>` into a temporary folder, with the package's
absolute imports renamed, so the old and new code run in the same process on the same
torch. Nothing of the old code lives in the tree: the ref is the only reference to it.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
# the last commit of main before the vectorised engine, the paged KV cache and the new dynamic rule
OLD_ENGINE_REF = "49d4c43"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def load_package(name: str, ref: str = OLD_ENGINE_REF) -> ModuleType:
    """The package `name` at `ref`, imported as `<name>_<ref>` with all its submodules loaded."""
    alias = f"{name}_{re.sub(r'[^0-9A-Za-z]', '_', ref)}"
    if alias in sys.modules:
        return sys.modules[alias]
    folder = Path(tempfile.mkdtemp(prefix="dlrl-ref-"))
    pattern = re.compile(rf"\b(from|import) {name}(?=[ .])")
    modules = []
    for path in _git("ls-tree", "-r", "--name-only", ref, f"{name}/").split():
        if not path.endswith(".py"):
            continue
        out = folder / alias / Path(path).relative_to(name)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(pattern.sub(rf"\1 {alias}", _git("show", f"{ref}:{path}")))
        modules.append(".".join(Path(path).relative_to(name).with_suffix("").parts))
    sys.path.insert(0, str(folder))
    package = importlib.import_module(alias)
    for mod in sorted(m for m in modules if m != "__init__"):
        try:
            importlib.import_module(f"{alias}.{mod}")
        except ImportError:  # optional heavy modules (training) are not needed by the engines
            pass
    return package
