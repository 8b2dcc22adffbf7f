#!/usr/bin/env bash
# The deployment topology on one machine: NUM_SERVERS `dlrl serve` processes and a trainer of
# NUM_RANKS ranks under torchrun, started with the commands the compose / Kubernetes / Slurm
# manifests use. Stops the servers (SIGTERM: drain, exit 0) when the trainer is done.
#
#   deploy/local/run.sh                                    # tiny default, 2 servers, 2 ranks, 60 steps
#   deploy/local/run.sh --model runs/tiny-sft --steps 5 --out runs/local -- train.objective=dipo
#
# Options: --model DIR ("" = the embedded tiny default), --steps N, --out DIR (runs/local), --port P
# (servers on P, P+1, ...; 8000), --servers N (2), --ranks N (2), --transport shm|dist|http (shm),
# --device auto|cpu|cuda (auto), --config FILE (configs/tiny.yaml), --store URL (the servers record a
# sample of what they serve into this feedback store, e.g. postgresql://dlrl@127.0.0.1:5432/dlrl
# with PGPASSWORD set: the compose/Kubernetes topology; default: no recording). Arguments after `--`
# are more trainer keys. The script ends with $OUT/servers.json: each server's weight version and checksum.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ -x .venv/bin/dlrl ]]; then PATH="$PWD/.venv/bin:$PATH"; fi

CONFIG=configs/tiny.yaml
MODEL=""
STEPS=60
OUT=runs/local
PORT=8000
NUM_SERVERS=2
NUM_RANKS=2
TRANSPORT=shm
DEVICE=auto
STORE=""
while (( $# )); do
  case $1 in
    --config) CONFIG=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --servers) NUM_SERVERS=$2; shift 2 ;;
    --ranks) NUM_RANKS=$2; shift 2 ;;
    --transport) TRANSPORT=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    --store) STORE=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

mkdir -p "$OUT"
TOKEN_FILE=$OUT/admin_token
if [[ ! -s $TOKEN_FILE ]]; then
  (umask 077; python -c 'import secrets; print(secrets.token_urlsafe(24))' > "$TOKEN_FILE")
fi
MASTER_PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

urls=()
pids=()
stop_servers() {  # SIGTERM: each server drains and exits 0
  local pid status=0
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
  pids=()
  return "$status"
}
trap 'stop_servers || true' EXIT
trap 'exit 143' TERM INT

record=()
if [[ -n $STORE ]]; then record=(server.record=sample server.store="$STORE"); fi
for ((i = 0; i < NUM_SERVERS; i++)); do
  port=$((PORT + i))
  dlrl serve --config "$CONFIG" --host 127.0.0.1 --port "$port" \
    server.model="$MODEL" server.device="$DEVICE" server.admin_token_file="$TOKEN_FILE" "${record[@]}" \
    > "$OUT/server-$port.log" 2>&1 &
  pids+=("$!")
  urls+=("http://127.0.0.1:$port")
done
SERVER_URLS="[$(IFS=,; echo "${urls[*]}")]"
echo "run.sh: servers ${SERVER_URLS}, logs in $OUT/server-*.log"
# wait (bounded) until every server answers /ready; a server that exits stops the script with its log
ready=()
for ((i = 0; i < NUM_SERVERS; i++)); do ready+=("${urls[i]}=${pids[i]}"); done
python -m rollout_client.ready --name run.sh --timeout "${READY_TIMEOUT:-600}" "${ready[@]}"

DLRL_ADMIN_TOKEN=$(<"$TOKEN_FILE")
export DLRL_ADMIN_TOKEN
torchrun --nnodes=1 --node_rank=0 --nproc_per_node="$NUM_RANKS" --master_addr=127.0.0.1 --master_port="$MASTER_PORT" \
  -m dlrl.cli train --config "$CONFIG" train.servers="$SERVER_URLS" train.start_server=false \
  train.model="$MODEL" train.sync_transport="$TRANSPORT" train.sync_addr=127.0.0.1 \
  train.output_dir="$OUT/run" "train.num_steps=$STEPS" "$@"

# what every server holds now (the trainer's final weights: compare with weights_digest of $OUT/run/final)
python - "$OUT/servers.json" "${urls[@]}" <<'PY'
import json, os, sys
import httpx
headers = {"Authorization": f"Bearer {os.environ['DLRL_ADMIN_TOKEN']}"}
state = {url: {"version": httpx.get(url + "/weights/version", headers=headers, timeout=30).json()["version"],
               "digest": httpx.get(url + "/weights/checksum", headers=headers, timeout=60).json()["digest"]}
         for url in sys.argv[2:]}
with open(sys.argv[1], "w") as f:
    json.dump(state, f, indent=2)
print(json.dumps(state, indent=2))
PY
stop_servers
echo "run.sh: done; outputs in $OUT/run"
