# dlrl — make targets. `make test` on a fresh machine installs everything it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# DeepSpeed's JIT-built ops: the venv's own folder, which `dlrl train` defaults to as well (trainer/extensions.py);
# built once by `make install`
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
ARGS ?=

.PHONY: install packages extensions test test-fast lint typecheck contracts bench soak serve train train-llada sft align clean

# DeepSpeed's CPU communication op, JIT-built once (trainer/extensions.py)
OP := $(TORCH_EXTENSIONS_DIR)/deepspeed_shm_comm/deepspeed_shm_comm.so

install: packages extensions

# the environment: packages (pip compiles their .pyc files: with PYTHONDONTWRITEBYTECODE=1, as on the CI box,
# none would be written later and every process would compile torch from source) and the headless browser
packages: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[server,train,postgres,data,dev]'
	$(PY) -m tests.browser  # headless Chromium for the align console test (apt-get as root when missing)
	touch $(STAMP)

# DeepSpeed's CPU op, built once here rather than inside the first `dlrl train` (.ci/run builds it beside lint)
extensions: $(OP)

$(OP): $(STAMP)
	$(PY) -m trainer.extensions

# make test's parallel workers (pytest-xdist): whole test files per worker, the files with a `slow` test first
# (tests/conftest.py); 2 = one per core of the 2-core box. JOBS=0 runs the suite in this one process.
JOBS ?= 2
XDIST := $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile --no-loadscope-reorder)

test: install
	$(PY) -m pytest -q -x --durations=40 $(XDIST) tests $(ARGS)

# the fast tier (a developer's edit loop; `make test` runs these too): unit tests only, no servers, no DeepSpeed builds;
# under a minute on a 2-core box. A test file joins when it starts no process and no server.
FAST_TESTS := \
	tests/dlrl/test_import_contracts.py \
	tests/dlrl/test_sampling_options.py \
	tests/dlrl/test_cli_help.py \
	tests/dllm/test_dllm_batched.py \
	tests/dllm/test_dllm_decoding.py \
	tests/dllm/test_dllm_detokenize.py \
	tests/dllm/test_dllm_kv_cache.py \
	tests/dllm/test_dllm_model.py \
	tests/dllm/test_dllm_weights.py \
	tests/dllm/test_full_schedule.py \
	tests/dllm/test_official_equivalence.py \
	tests/trainer/test_advantages.py \
	tests/trainer/test_correction.py \
	tests/trainer/test_data.py \
	tests/trainer/test_full_attention_objectives.py \
	tests/trainer/test_metrics_log.py \
	tests/trainer/test_objectives.py \
	tests/trainer/test_replay.py \
	tests/trainer/test_rewards.py \
	tests/trainer/test_rewards_custom.py \
	tests/trainer/test_value_model.py \
	tests/trainer/align/test_align_gate.py \
	tests/weight_sync/test_weight_sync_manifest.py \
	tests/server/test_lmdeploy_params.py

test-fast: packages
	$(PY) -m pytest -q -x $(FAST_TESTS) $(ARGS)

contracts: packages  # docs/DESIGN.md's import contracts (an ast check: names the file, line and import)
	$(PY) -m pytest -q tests/dlrl/test_import_contracts.py

lint: packages
	$(VENV)/bin/ruff check dlrl dlrl_config dllm server trainer weight_sync rollout_client store tests benchmarks examples
	$(VENV)/bin/mypy

typecheck: packages  # mypy over the packages ([tool.mypy] in pyproject.toml; cache in .mypy_cache/)
	$(VENV)/bin/mypy

bench: install
	$(PY) benchmarks/decode.py
	$(PY) benchmarks/serve.py
	$(PY) benchmarks/sync.py
	$(PY) benchmarks/step.py
	$(PY) benchmarks/rollback.py

soak: install
	$(PY) benchmarks/soak.py $(ARGS)

sft: install
	$(VENV)/bin/dlrl sft --config configs/tiny.yaml $(ARGS)

serve: install
	$(VENV)/bin/dlrl serve --config configs/tiny.yaml $(ARGS)

train: install
	$(VENV)/bin/dlrl train --config configs/tiny.yaml $(ARGS)

train-llada: install
	$(VENV)/bin/dlrl train --config configs/tiny_llada.yaml $(ARGS)

align: install
	$(PY) -m examples.align.local --config configs/align.yaml $(ARGS)

clean:
	rm -rf runs .pytest_cache
