"""WeightBank: the weights of promoted versions, and the frozen reference (the serving version) in the trainer.

    bank = WeightBank(Path("runs/align/promoted"), reference_module, keep=3)
    bank.put(7, weights)              # {name: CPU tensor}; saved to promoted/v7.safetensors, kept in memory
    bank.get(7)                       # from memory, else from disk, else None
    bank.set_reference(7)             # the gate's KL reference now holds version 7's weights
    bank.digest(7, dtype)             # weights_digest as a server serving it in `dtype` reports it

Every version that reaches a replica (canary or serving) is saved first: a replica that was down
during a promotion, or one rolled back further than it keeps, is brought to it from here. The
`keep` most recent stay in host memory too (a push needs no disk read).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from dllm.weights import copy_into_model
from weight_sync import weights_digest

if TYPE_CHECKING:
    from trainer.rl.value_model import Policy


class WeightBank:
    def __init__(self, root: Path, reference: Policy, keep: int = 3):
        self.root, self.reference, self.keep = Path(root), reference, keep
        self.root.mkdir(parents=True, exist_ok=True)
        self.memory: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self.reference_version: int | None = None

    def path(self, version: int) -> Path:
        return self.root / f"v{int(version)}.safetensors"

    def put(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        weights = {n: t.detach().to("cpu").contiguous() for n, t in weights.items()}
        path = self.path(version)
        if not path.is_file():
            tmp = path.with_suffix(".tmp")
            save_file(weights, str(tmp))
            tmp.replace(path)  # whole or not at all
        self._remember(version, weights)

    def _remember(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.memory[int(version)] = weights
        self.memory.move_to_end(int(version))
        while len(self.memory) > self.keep:
            self.memory.popitem(last=False)

    def get(self, version: int) -> dict[str, torch.Tensor] | None:
        if int(version) in self.memory:
            self.memory.move_to_end(int(version))
            return self.memory[int(version)]
        path = self.path(version)
        if not path.is_file():
            return None

        weights = load_file(str(path))
        self._remember(version, weights)
        return weights

    def has(self, version: int) -> bool:
        return int(version) in self.memory or self.path(version).is_file()

    @torch.no_grad()
    def set_reference(self, version: int) -> None:
        if self.reference_version == version:
            return
        weights = self.get(version)
        if weights is None:
            raise KeyError(f"version {version}: no saved weights in {self.root}")
        copy_into_model(self.reference, weights.items())
        self.reference_version = version

    def digest(self, version: int, dtype: torch.dtype | None = None) -> str | None:
        weights = self.get(version)
        if weights is None:
            return None
        return weights_digest({n: (t.to(dtype) if dtype is not None else t) for n, t in weights.items()})
