"""`import deepspeed` without the tracker DeepSpeed's autotuner imports and dlrl never uses.

    deepspeed = import_deepspeed()   # instead of `import deepspeed` (trainer/infra/dist.py, ds_engine.py)

DeepSpeed imports its autotuner at import time, and the autotuner imports mlflow whenever it is installed
(`pip install dlrl[trackers]`, the dev extra): about 2.7 s of CPU in every trainer process and rank, most of
DeepSpeed's own import (benchmarks/RESULTS.md, "Test suite"). Only autotuning uses it, which dlrl never
runs. So while DeepSpeed is first imported, `import mlflow` fails (the autotuner catches that and goes
without); afterwards mlflow imports as usual, for `train.report_to`'s mlflow tracker (an mlflow imported
before DeepSpeed stays what it is: modules already imported are not looked up again).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

SKIPPED = frozenset({"mlflow"})  # imported by deepspeed.autotuning.autotuner, used only by autotuning


class _Skip(importlib.abc.MetaPathFinder):
    """Refuses SKIPPED packages (ModuleNotFoundError) while it is on sys.meta_path."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] in SKIPPED:
            raise ModuleNotFoundError(f"{fullname} is not imported while DeepSpeed is (dlrl never autotunes)",
                                      name=fullname)
        return None


def import_deepspeed() -> ModuleType:
    """The `deepspeed` module, imported (once per process) without SKIPPED."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    skip = _Skip()
    sys.meta_path.insert(0, skip)
    try:
        import deepspeed
    finally:
        sys.meta_path.remove(skip)
    return deepspeed
