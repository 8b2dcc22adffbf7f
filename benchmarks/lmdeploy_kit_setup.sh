# shellcheck shell=bash
# LMDeploy on a device machine (built by benchmarks/lmdeploy_kit.sh), from the repo root:   source .lmdkit/setup.sh
# Installs .lmdkit/*.whl --no-deps into /tmp/lmdsite (LMDeploy's own environment, over the device's torch / CUDA /
# transformers / triton), puts it first on PYTHONPATH, and imports what server.backend=lmdeploy uses.
# Sourceable: it never exits the caller's shell; failures are printed as "lmdkit: ... FAILED".
_lmdkit_setup() {
    local root=$PWD
    if ! ls "$root"/.lmdkit/lmdeploy-*.whl >/dev/null 2>&1; then
        echo "lmdkit: no .lmdkit/lmdeploy-*.whl in $root (bash benchmarks/lmdeploy_kit.sh, carry .lmdkit) FAILED"
        return 1
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lmdsite \
        "$root"/.lmdkit/*.whl || echo "lmdkit: wheel install FAILED"
    export PYTHONPATH=/tmp/lmdsite:${PYTHONPATH:-$root}
    python3 - <<'EOF' || echo "lmdkit: imports FAILED"
import torch
import lmdeploy
from lmdeploy import GenerationConfig, PytorchEngineConfig  # noqa: F401
from lmdeploy.pytorch.engine import Engine  # noqa: F401
import lmdeploy.pytorch.models.sdar  # noqa: F401
import lmdeploy.pytorch.strategies.dllm.model_agent  # noqa: F401
from lmdeploy.serve.openai.protocol import UpdateParamsRequest  # noqa: F401
from lmdeploy.utils import FlattenedTensorBucket, serialize_state_dict  # noqa: F401
print(f"lmdkit: lmdeploy {lmdeploy.__version__}, torch {torch.__version__}, cuda {torch.cuda.is_available()}")
EOF
}
_lmdkit_setup
