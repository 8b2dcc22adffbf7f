"""Where DeepSpeed's JIT-built C++ ops live, and saying so before the one slow build.

    ensure_extensions_dir()            # TORCH_EXTENSIONS_DIR, default <venv>/torch_extensions
    with announced_build(cpu=True):    # around deepspeed.init_distributed: one line before a build,
        deepspeed.init_distributed()   # nothing on later runs (DeepSpeed's "built successfully" is kept quiet)

On CPU, DeepSpeed builds its shared-memory communication op (`deepspeed_shm_comm`) the first
time a process group starts: minutes on a small box, silently. `dlrl train` / `dlrl align` (and
`make train`, whose Makefile points at the same folder) build it once into this cache and reuse it.
`make install` builds it ahead (`python -m trainer.extensions`), so the first `dlrl train` of a fresh
machine (or of a new virtual environment: torch's build hash includes the venv's paths) does not stall.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path

CPU_OP = "deepspeed_shm_comm"  # deepspeed.comm.torch.build_shm_op on the CPU accelerator
BUILD_MINUTES = "1-5"  # measured: ~1 min on an idle 2-core box, 4.5 min on a loaded one (issue 38)


def default_extensions_dir() -> Path:
    """Inside a virtual environment its own `torch_extensions` folder (torch's build hash includes the
    environment's paths: two environments sharing one folder rebuild the op in turn, and a build one
    of them kills leaves a lock the other waits on); outside one, ~/.cache/dlrl/torch_extensions."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "torch_extensions"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dlrl" / "torch_extensions"


def ensure_extensions_dir() -> Path:
    """TORCH_EXTENSIONS_DIR (set to the default when unset, for this process and the ones it starts); the
    environment's own ninja first on PATH (`pin_ninja`)."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(default_extensions_dir())
    pin_ninja()
    return Path(os.environ["TORCH_EXTENSIONS_DIR"])


def pin_ninja() -> None:
    """Put the folder of this Python (a virtual environment's bin/, where pip installs `ninja` with torch's build
    tools) first on PATH when it holds a ninja, for this process and the ones it starts. torch builds ops with
    whatever `ninja` PATH finds, and ninja 1.11 (a system one) and 1.13 (pip's) hash the commands in the build
    folder's .ninja_log differently: a build by one looks out of date to the other, so processes started with
    and without the environment's bin/ on PATH rebuilt the op in turn (a minute each, every other trainer
    process waiting on torch's lock meanwhile)."""
    own = Path(sys.executable).parent
    path = os.environ.get("PATH", "")
    if (own / "ninja").is_file() and path.split(os.pathsep)[0] != str(own):
        os.environ["PATH"] = f"{own}{os.pathsep}{path}" if path else str(own)


def is_built(op: str = CPU_OP) -> bool:
    return (ensure_extensions_dir() / op / f"{op}.so").is_file()


@contextlib.contextmanager
def announced_build(cpu: bool, op: str = CPU_OP) -> Iterator[None]:
    """On CPU, one line on stderr before DeepSpeed builds `op` (first run only; local rank 0 says it);
    DeepSpeed's own "built successfully" line, printed on every run, is swallowed (other output passes)."""
    if not cpu:
        yield
        return
    folder = ensure_extensions_dir()
    if not is_built(op) and os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"dlrl: building DeepSpeed's CPU communication op ({op}) once, ~{BUILD_MINUTES} min; cached in "
              f"{folder} (TORCH_EXTENSIONS_DIR) for later runs", file=sys.stderr, flush=True)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            yield
    finally:
        rest = "".join(line for line in out.getvalue().splitlines(keepends=True) if "built successfully" not in line)
        sys.stdout.write(rest)


def build_cpu_op() -> bool:
    """Build (or find built) DeepSpeed's CPU communication op now; False where DeepSpeed has no such op."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ensure_extensions_dir()
    from trainer.infra.ds_import import import_deepspeed

    import_deepspeed()
    from deepspeed.comm.torch import build_shm_op

    with announced_build(cpu=True):
        return build_shm_op() is not None


if __name__ == "__main__":
    print(f"DeepSpeed CPU op {CPU_OP}: {'ready' if build_cpu_op() else 'not available'} in {ensure_extensions_dir()}")
