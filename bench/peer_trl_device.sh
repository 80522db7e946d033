#!/usr/bin/env bash
# bench/peer_trl.py on a lent H200 (the `device` tool): TRL's GRPOTrainer beside `star train`, one after the
# other, in one background job. The wheels (PEER_PACKAGES included) and the GGUF arrive through
# bench/gpu_device.sh (pack here; put … install there); TRL runs in the device's own Python with them.
#
#   bench/gpu_device.sh pack                   # here, once
#   bench/gpu_device.sh put | install          # device calls, one per part
#   bench/peer_trl_device.sh start [peer_trl.py options]   # starts the job, then polls 9 min
#   bench/gpu_device.sh poll 'peer_trl*'       # later calls: up to 9 min each; bench/results/peer_trl.* to $OUT
#
# Sized for 24 minutes of an H200: 40 steps a side, each side capped at 9 minutes of RL (a capped side records
# the steps it made), 100 held-out queries evaluated three times. Measured: ours 40 steps in 7 minutes (5.9 s a
# step after a 70 s start), TRL 10 in its 9 (52 s a step); TRL's 40 steps alone would take about 35 minutes
# (--side-minutes 0 lifts the cap where the device budget holds it). The job outlives a call
# (bench/gpu_device.sh start).
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/site GGUF=/tmp/star-gguf/SmolLM2-135M-Instruct.Q4_1.gguf
PY=${PYTHON:-python3}  # the device's own Python; TRL's side runs in it too

start() {
  [ -d "$SITE/vllm" ] && [ -d "$SITE/trl" ] && [ -f "$GGUF" ] || {
    echo "run bench/gpu_device.sh put … install first (with PEER_PACKAGES packed)" >&2
    exit 1
  }
  bench/gpu_device.sh start "$PY" bench/peer_trl.py --gguf "$GGUF" --work /tmp/star-peer --trl-python "$PY" \
    --steps 40 --heldout 100 --side-minutes 9 "$@"
  bench/gpu_device.sh poll 'peer_trl*'
}

case "${1:-}" in
  start) shift; start "$@" ;;
  poll) bench/gpu_device.sh poll 'peer_trl*' ;;
  *) echo "usage: $0 start [peer_trl.py options] | poll" >&2; exit 2 ;;
esac
