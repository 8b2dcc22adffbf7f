#!/bin/bash
# The SFT -> RL gain through lm-eval-harness (README, "Evaluating with lm-eval-harness"): serve each model with
# `dlrl serve`, run the README's two lm_eval commands on the 100 held-out problems, stop the server.
#
#   bash benchmarks/lm_eval_gain.sh configs/tiny.yaml runs/tiny-sft:8474 runs/tiny-rl/final:8475
#   bash benchmarks/lm_eval_gain.sh configs/tiny_llada.yaml runs/tiny-llada-sft:8474 runs/tiny-llada-rl/final:8475
#
# (after `make train` / `make train-llada`; offline; numbers in benchmarks/RESULTS.md, "lm-eval recipe")
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
VENV=${VENV:-.venv}
CFG=$1; shift
for spec in "$@"; do
  model=${spec%%:*}; port=${spec##*:}
  "$VENV/bin/dlrl" serve --config "$CFG" server.model="$model" server.port="$port" > "/tmp/lm_eval_gain_$port.log" 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  until curl -sf "localhost:$port/ready" > /dev/null; do
    kill -0 $pid 2>/dev/null || { echo "dlrl serve exited: /tmp/lm_eval_gain_$port.log"; exit 1; }
    sleep 2
  done
  name=$(curl -s "localhost:$port/v1/models" | "$VENV/bin/python" -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
  echo "== $model served as $name"
  for task in dlrl_addition_mc dlrl_addition_gen; do
    start=$(date +%s)
    "$VENV/bin/lm_eval" --model local-completions \
      --model_args "base_url=http://127.0.0.1:$port/v1/completions,model=$name,tokenizer_backend=huggingface,tokenizer=$model" \
      --include_path examples/lm_eval --tasks "$task" 2>&1 | grep -E "^\|dlrl"
    echo "   ($task: $(( $(date +%s) - start )) s wall)"
  done
  kill $pid; wait $pid || true
done
