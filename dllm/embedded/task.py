"""The embedded synthetic task: fixed-width addition with an exact answer, and an imperfect teacher.

    task = ArithmeticTask(min_digits=2, max_digits=2, teacher_carry_error=0.6)
    task.split("train", 5)    # [{"prompt": "37+85=", "answer": "122"}, ...]  (always the true sum)
    task.split("heldout", 200)
    next(task.stream(seed=0)) # an SFT demonstration, from the imperfect teacher

With `fixed_width` (default) operands are zero-padded to max_digits and the answer to
max_digits + 1, so every digit has a fixed position. Problems are split deterministically
by a hash of (a, b), so the held-out problems never appear in training. Prompts are plain
text; the model completes the answer followed by the end-of-text token.

The imperfect teacher (`teacher_carry_error` p): on a problem that needs a carry, an SFT
demo shows the carry-free digit-wise sum (37+85 -> "012") with probability p, the true
sum otherwise. With p > 0.5 a well-fit SFT model has learned both answers, but its greedy
decode follows the majority (the carry-free mistake): held-out greedy accuracy is about
the share of carry-free problems (~30% for 2-digit operands), while sampling still finds
the right answer on ~25% of carry samples: enough for RL with the exact-match reward to
flip the mode (configs/tiny.yaml: ~30% after SFT -> 80-90% after 60 RL steps).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

from pydantic import Field

from dlrl_config import Config

SPLITS = ("train", "heldout")


class ArithmeticTask(Config):
    """Section `task`: the synthetic addition task."""

    min_digits: int = Field(2, ge=1, le=9)  # fewest digits per operand
    max_digits: int = Field(2, ge=1, le=9)  # most digits per operand
    heldout_fraction: float = Field(0.1, gt=0, lt=1)  # share of problems held out from SFT and RL
    fixed_width: bool = True  # zero-pad operands to max_digits and the answer to max_digits + 1
    teacher_carry_error: float = Field(0.6, ge=0, le=1)  # SFT demos drop the carries with this probability
    seed: int = 0  # seed of the train/held-out split

    def check(self) -> None:
        if self.min_digits > self.max_digits:
            raise ValueError("task.max_digits: need min_digits <= max_digits")

    def _split_of(self, a: int, b: int) -> str:
        h = int.from_bytes(hashlib.blake2b(f"{a}+{b}".encode(), digest_size=4).digest(), "little")
        return "heldout" if (h % 10_000) < self.heldout_fraction * 10_000 else "train"

    def format(self, a: int, b: int, total: int | None = None) -> dict:
        total = a + b if total is None else total
        if self.fixed_width:
            w = self.max_digits
            return {"prompt": f"{a:0{w}d}+{b:0{w}d}=", "answer": f"{total:0{w + 1}d}"}
        return {"prompt": f"{a}+{b}=", "answer": str(total)}

    @staticmethod
    def carry_free_sum(a: int, b: int) -> int:
        """Digit-wise sum mod 10: the answer of a teacher that forgets every carry."""
        out, place = 0, 1
        while a or b:
            out += ((a % 10 + b % 10) % 10) * place
            a, b, place = a // 10, b // 10, place * 10
        return out

    def _draw(self, rng: random.Random) -> tuple[int, int]:
        def num() -> int:
            d = rng.randint(self.min_digits, self.max_digits)
            return rng.randint(0 if d == 1 else 10 ** (d - 1), 10 ** d - 1)
        return num(), num()

    def split(self, name: str, n: int, seed: int | None = None) -> list[dict]:
        """n examples of split `name`; the same (name, n, seed) always gives the same list."""
        if name not in SPLITS:
            raise ValueError(f"split: unknown {name!r} (known: {', '.join(SPLITS)})")
        rng = random.Random(f"{self.seed if seed is None else seed}-{name}")
        out: list[dict] = []
        while len(out) < n:
            a, b = self._draw(rng)
            if self._split_of(a, b) == name:
                out.append(self.format(a, b))
        return out

    def stream(self, seed: int) -> Iterator[dict]:
        """Endless SFT demonstrations from the train split. With `teacher_carry_error` p, a
        demo of a problem that needs a carry shows the carry-free (wrong) answer with
        probability p: an imperfect teacher, whose mistakes RL with the exact-match reward
        can correct. The answer of `split()` examples is always the true sum."""
        rng = random.Random(f"stream-{seed}")
        while True:
            a, b = self._draw(rng)
            if self._split_of(a, b) != "train":
                continue
            if self.teacher_carry_error and rng.random() < self.teacher_carry_error:
                yield self.format(a, b, self.carry_free_sum(a, b))
            else:
                yield self.format(a, b)
