#!/usr/bin/env bash
# Launch coordrl GRPO training on one node (or one node of several): reader fleet + accelerate.
#
#   scripts/launch_grpo.sh [--print-only] CONFIG [--field VALUE ...]
#
# 1. Reads reader_gpus, reader_model, deepspeed_stage, deepspeed_offload (CONFIG, then the overrides).
# 2. Checks the plan: python -m coordrl.cli.plan (skip with PLAN_CHECK=0).
# 3. Starts the readers on GPUs 0..reader_gpus-1 in the background, in their own process group:
#      coordrl serve-readers --model <reader_model> --gpus 0,1 --urls-file <RUN_DIR>/reader_urls.txt
#    and waits until the URL file appears (serve-readers writes it once every server answers /health).
# 4. Runs training on the remaining GPUs, one process per GPU:
#      CUDA_VISIBLE_DEVICES=<rest> accelerate launch --config_file configs/zero{2,3}.yaml \
#        --num_processes <rest x NUM_NODES> -m coordrl.cli train --config CONFIG --readers <urls> [overrides]
#    (deepspeed_stage 0: plain multi-GPU DDP, no accelerate config file).
# 5. Stops the readers on exit, failure, Ctrl-C or SIGTERM (SIGTERM to their process group, SIGKILL after
#    READER_STOP_GRACE_S).
# With reader_gpus: 0 no readers are started and the config's `readers` (lexical or URLs) is used.
#
# --print-only (or DRY_RUN=1): print the commands, start nothing.
#
# Environment:
#   GPUS_PER_NODE       GPUs on this node (default: nvidia-smi -L count; 8 with --print-only and no GPU)
#   NUM_NODES           nodes (default 1); every node runs this script and its own reader fleet
#   NODE_RANK           this node's rank (default 0)                  -> accelerate --machine_rank
#   MAIN_PROCESS_IP     rank-0 node address (required if NUM_NODES>1) -> accelerate --main_process_ip
#   MAIN_PROCESS_PORT   rendezvous port (default 29500)               -> accelerate --main_process_port
#   GPU_MEMORY_GB       memory per GPU for the plan check (default: nvidia-smi, else 80)
#   PLAN_CHECK          0 to skip the plan check (default 1)
#   RUN_DIR             where the reader URL file and logs go (default: a new /tmp/coordrl-launch.* dir)
#   READER_PORT_BASE    first reader port (default 8100)
#   READER_ARGS         extra arguments for serve-readers, e.g. "--python /opt/vllm/bin/python"
#   READER_TIMEOUT_S    how long to wait for the readers (default 1800)
#   READER_STOP_GRACE_S seconds between SIGTERM and SIGKILL when stopping the readers (default 60)
#   PYTHON              interpreter with coordrl installed (default: the repo's .venv, else python3)
#   ACCELERATE          accelerate executable (default: next to PYTHON, else `accelerate`)
# GPU indices are physical: run with CUDA_VISIBLE_DEVICES unset.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PRINT_ONLY="${DRY_RUN:-0}"
ARGS=()
for a in "$@"; do
  if [ "$a" = "--print-only" ]; then PRINT_ONLY=1; else ARGS+=("$a"); fi
done
if [ "${#ARGS[@]}" -lt 1 ] || [ "${ARGS[0]#--}" != "${ARGS[0]}" ]; then
  echo "usage: $0 [--print-only] CONFIG [--field VALUE ...]" >&2
  exit 2
fi
CONFIG="${ARGS[0]}"
OVERRIDES=("${ARGS[@]:1}")
[ -f "$CONFIG" ] || { echo "launch_grpo: config not found: $CONFIG" >&2; exit 2; }

PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON="$(command -v python3)"; fi
fi
ACCELERATE="${ACCELERATE:-}"
if [ -z "$ACCELERATE" ]; then
  if [ -x "$(dirname "$PYTHON")/accelerate" ]; then ACCELERATE="$(dirname "$PYTHON")/accelerate"; else ACCELERATE=accelerate; fi
fi

# The few launch settings, from the YAML then the overrides (--key VALUE or --key=VALUE).
SETTINGS="$("$PYTHON" - "$CONFIG" "${OVERRIDES[@]}" <<'PY'
import shlex, sys, yaml
cfg = yaml.safe_load(open(sys.argv[1])) or {}
args = sys.argv[2:]
i = 0
while i < len(args):
    key = args[i][2:].replace("-", "_") if args[i].startswith("--") else None
    if key and "=" in key:
        key, value = key.split("=", 1); i += 1
    elif key and i + 1 < len(args):
        value = args[i + 1]; i += 2
    else:
        i += 1; continue
    cfg[key] = yaml.safe_load(value)
truthy = lambda v: str(v).lower() in ("true", "1", "yes")
out = {
    "READER_GPUS": int(cfg.get("reader_gpus") or 0),
    "READER_MODEL": cfg.get("reader_model") or "",
    "DS_STAGE": int(cfg.get("deepspeed_stage") or 0),
    "DS_OFFLOAD": 1 if truthy(cfg.get("deepspeed_offload", False)) else 0,
    "VLLM_SERVER": 1 if truthy(cfg.get("use_vllm", False)) and cfg.get("vllm_mode", "colocate") == "server" else 0,
}
for k, v in out.items():
    print(f"{k}={shlex.quote(str(v))}")
PY
)"
eval "$SETTINGS"
if [ "$VLLM_SERVER" = 1 ]; then
  echo "launch_grpo: vllm_mode: server is not launched by this script; use vllm_mode: colocate, or start" \
       "the policy server yourself (trl vllm-serve) and run accelerate directly" >&2
  exit 2
fi

if [ -z "${GPUS_PER_NODE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    GPUS_PER_NODE="$(nvidia-smi -L | grep -c '^GPU')"
  elif [ "$PRINT_ONLY" = 1 ]; then
    GPUS_PER_NODE=8
  else
    echo "launch_grpo: no GPU found (nvidia-smi); set GPUS_PER_NODE" >&2; exit 2
  fi
fi
if [ -z "${GPU_MEMORY_GB:-}" ]; then
  GPU_MEMORY_GB=80
  if command -v nvidia-smi >/dev/null 2>&1 && mib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)" && [ -n "$mib" ]; then
    GPU_MEMORY_GB="$(awk -v m="$mib" 'BEGIN { printf "%.1f", m / 1024 }')"
  fi
fi
NUM_NODES="${NUM_NODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MAIN_PROCESS_PORT="${MAIN_PROCESS_PORT:-29500}"
if [ "$NUM_NODES" -gt 1 ] && [ -z "${MAIN_PROCESS_IP:-}" ]; then
  echo "launch_grpo: NUM_NODES=$NUM_NODES needs MAIN_PROCESS_IP" >&2; exit 2
fi

# GPU split: readers first, the rest train.
if [ "$READER_GPUS" -ge "$GPUS_PER_NODE" ]; then
  echo "launch_grpo: reader_gpus=$READER_GPUS leaves no training GPU of $GPUS_PER_NODE" >&2; exit 2
fi
READER_IDS="$(seq -s, 0 $((READER_GPUS - 1)) 2>/dev/null || true)"
TRAIN_IDS="$(seq -s, "$READER_GPUS" $((GPUS_PER_NODE - 1)))"
TRAIN_PER_NODE=$((GPUS_PER_NODE - READER_GPUS))
NUM_PROCESSES=$((TRAIN_PER_NODE * NUM_NODES))

ACC=("$ACCELERATE" launch)
case "$DS_STAGE" in
  2|3) ACC+=(--config_file "$REPO/configs/zero$DS_STAGE.yaml")
       if [ "$DS_OFFLOAD" = 1 ]; then
         ACC+=(--offload_optimizer_device cpu)
         [ "$DS_STAGE" = 3 ] && ACC+=(--offload_param_device cpu)
       fi ;;
  0)   [ "$NUM_PROCESSES" -gt 1 ] && ACC+=(--multi_gpu) ;;
  *)   echo "launch_grpo: deepspeed_stage must be 0, 2 or 3, got $DS_STAGE" >&2; exit 2 ;;
esac
ACC+=(--num_processes "$NUM_PROCESSES")
if [ "$NUM_NODES" -gt 1 ]; then
  ACC+=(--num_machines "$NUM_NODES" --machine_rank "$NODE_RANK" --main_process_ip "$MAIN_PROCESS_IP"
        --main_process_port "$MAIN_PROCESS_PORT")
fi
ACC+=(-m coordrl.cli train --config "$CONFIG")

PLAN=("$PYTHON" -m coordrl.cli.plan "$CONFIG" --gpus-per-node "$GPUS_PER_NODE" --num-nodes "$NUM_NODES"
      --gpu-memory-gb "$GPU_MEMORY_GB" "${OVERRIDES[@]}")
RUN_DIR="${RUN_DIR:-}"
READER_PORT_BASE="${READER_PORT_BASE:-8100}"
# shellcheck disable=SC2206  # READER_ARGS is split on purpose
EXTRA_READER_ARGS=(${READER_ARGS:-})

# Print a command so it can be pasted: words with shell-special characters are single-quoted.
show() {
  local out="" a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then out+="$a "; else out+="'${a//\'/\'\\\'\'}' "; fi
  done
  echo "${out% }"
}

if [ "$PRINT_ONLY" = 1 ]; then
  URLS_FILE="${RUN_DIR:-<RUN_DIR>}/reader_urls.txt"
  [ "${PLAN_CHECK:-1}" = 1 ] && { printf 'plan:    '; show "${PLAN[@]}"; }
  if [ "$READER_GPUS" -gt 0 ]; then
    printf 'readers: '; show "$PYTHON" -m coordrl.cli serve-readers --model "$READER_MODEL" --gpus "$READER_IDS" \
      --port-base "$READER_PORT_BASE" --urls-file "$URLS_FILE" "${EXTRA_READER_ARGS[@]}"
    printf 'train:   CUDA_VISIBLE_DEVICES=%s ' "$TRAIN_IDS"; show "${ACC[@]}" --readers "<urls from $URLS_FILE>" "${OVERRIDES[@]}"
  else
    printf 'train:   CUDA_VISIBLE_DEVICES=%s ' "$TRAIN_IDS"; show "${ACC[@]}" "${OVERRIDES[@]}"
  fi
  exit 0
fi

if [ "${PLAN_CHECK:-1}" = 1 ]; then
  "${PLAN[@]}" || { echo "launch_grpo: the plan does not work (PLAN_CHECK=0 skips this check)" >&2; exit 2; }
fi

[ -n "$RUN_DIR" ] || RUN_DIR="$(mktemp -d "${TMPDIR:-/tmp}/coordrl-launch.XXXXXX")"
mkdir -p "$RUN_DIR"
URLS_FILE="$RUN_DIR/reader_urls.txt"
rm -f "$URLS_FILE"
READER_PID=""

stop_readers() {
  [ -n "$READER_PID" ] || return 0
  if kill -0 "$READER_PID" 2>/dev/null; then
    echo "launch_grpo: stopping readers (pid $READER_PID)" >&2
    # serve-readers turns SIGTERM into a clean stop of every server it started.
    kill -TERM -- "-$READER_PID" 2>/dev/null || kill -TERM "$READER_PID" 2>/dev/null || true
    for _ in $(seq 1 "${READER_STOP_GRACE_S:-60}"); do
      kill -0 "$READER_PID" 2>/dev/null || break
      sleep 1
    done
    kill -KILL -- "-$READER_PID" 2>/dev/null || kill -KILL "$READER_PID" 2>/dev/null || true
  fi
  wait "$READER_PID" 2>/dev/null || true
  READER_PID=""
}
trap stop_readers EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

TRAIN_READERS=()
if [ "$READER_GPUS" -gt 0 ]; then
  [ -n "$READER_MODEL" ] || { echo "launch_grpo: reader_gpus > 0 needs reader_model" >&2; exit 2; }
  echo "launch_grpo: starting readers on GPUs $READER_IDS (log: $RUN_DIR/serve-readers.log)" >&2
  # setsid: the fleet gets its own process group, so stopping it never signals this script.
  setsid "$PYTHON" -m coordrl.cli serve-readers --model "$READER_MODEL" --gpus "$READER_IDS" \
    --port-base "$READER_PORT_BASE" --urls-file "$URLS_FILE" --log-dir "$RUN_DIR" "${EXTRA_READER_ARGS[@]}" \
    >"$RUN_DIR/serve-readers.log" 2>&1 &
  READER_PID=$!
  deadline=$((SECONDS + ${READER_TIMEOUT_S:-1800}))
  until [ -s "$URLS_FILE" ]; do
    if ! kill -0 "$READER_PID" 2>/dev/null; then
      echo "launch_grpo: serve-readers exited before the readers were up:" >&2
      tail -n 40 "$RUN_DIR/serve-readers.log" >&2 || true
      exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "launch_grpo: readers not up after ${READER_TIMEOUT_S:-1800}s; see $RUN_DIR/serve-readers.log" >&2
      exit 1
    fi
    sleep 2
  done
  URLS="$(paste -sd, "$URLS_FILE")"
  echo "launch_grpo: readers up: $URLS" >&2
  TRAIN_READERS=(--readers "$URLS")
fi

echo "launch_grpo: training on GPUs $TRAIN_IDS ($NUM_PROCESSES processes over $NUM_NODES node(s))" >&2
set +e
CUDA_VISIBLE_DEVICES="$TRAIN_IDS" "${ACC[@]}" "${TRAIN_READERS[@]}" "${OVERRIDES[@]}"
rc=$?
set -e
echo "launch_grpo: training exited with status $rc" >&2
exit "$rc"
