# shellcheck shell=bash
# LMDeploy on a device machine (built by benchmarks/lmdeploy_kit.sh), from the repo root:   source .lmdkit/setup.sh
# Installs .lmdkit/*.whl --no-deps into $LMDSITE (/tmp/lmdsite: LMDeploy's own environment, over the device's
# torch / CUDA / transformers / triton) and puts it first on PYTHONPATH, after dlrl's carried wheels: LMDeploy
# imports pydantic (and more) from them, so .whl/*.whl go into $SITE (/tmp/site, as benchmarks/device_kit_setup.sh
# and lmdeploy_device.sh install them) unless that is done already, and $SITE is on PYTHONPATH BEFORE the import
# check runs. Then it imports what server.backend=lmdeploy uses.
# Sourceable: it never exits the caller's shell; failures are printed as "lmdkit: ... FAILED".
# Dry run on a CPU box (no CUDA, the kit built here):
#   SITE=/tmp/$USER-site LMDSITE=/tmp/$USER-lmdsite PYTHON=.venv/bin/python bash -c 'source benchmarks/lmdeploy_kit_setup.sh'
_lmdkit_setup() {
    local root=$PWD py=${PYTHON:-python3} site=${SITE:-/tmp/site} lmdsite=${LMDSITE:-/tmp/lmdsite} base
    if ! ls "$root"/.lmdkit/lmdeploy-*.whl >/dev/null 2>&1; then
        echo "lmdkit: no .lmdkit/lmdeploy-*.whl in $root (bash benchmarks/lmdeploy_kit.sh, carry .lmdkit) FAILED"
        return 1
    fi
    if ls "$root"/.whl/*.whl >/dev/null 2>&1 && [ ! -d "$site" ]; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$root"/.whl/*.whl \
            || echo "lmdkit: dlrl's wheels (.whl) install FAILED"
    fi
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$lmdsite" \
        "$root"/.lmdkit/*.whl || echo "lmdkit: wheel install FAILED"
    base=${PYTHONPATH:-$root}
    if [ -d "$site" ]; then
        case ":$base:" in *":$site:"*) ;; *) base=$site:$base ;; esac
    fi
    export PYTHONPATH=$lmdsite:$base
    echo "lmdkit: PYTHONPATH=$PYTHONPATH"
    "$py" -c "import pydantic" 2>/dev/null \
        || echo "lmdkit: pydantic is not importable: dlrl's wheels (.whl -> $site) first FAILED"
    "$py" - <<'EOF' || echo "lmdkit: imports FAILED"
import torch
import lmdeploy
from lmdeploy import GenerationConfig, PytorchEngineConfig  # noqa: F401
from lmdeploy.pytorch.engine import Engine  # noqa: F401
from lmdeploy.pytorch.engine.executor.uni_executor import UniExecutor  # noqa: F401
from lmdeploy.pytorch.engine.model_agent.agent import BaseModelAgent  # noqa: F401  # the weight path's target
import lmdeploy.pytorch.models.sdar  # noqa: F401
import lmdeploy.pytorch.strategies.dllm.model_agent  # noqa: F401
from lmdeploy.serve.openai.protocol import UpdateParamsRequest  # noqa: F401
from lmdeploy.utils import FlattenedTensorBucket  # noqa: F401
print(f"lmdkit: lmdeploy {lmdeploy.__version__}, torch {torch.__version__}, cuda {torch.cuda.is_available()}")
EOF
}
_lmdkit_setup
