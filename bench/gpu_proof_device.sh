#!/usr/bin/env bash
# bench/gpu_proof.py on a lent GPU machine (the `device` tool), over several calls: the wheels and the
# GGUF arrive through bench/gpu_device.sh (put … install), then the proof runs in the background (a
# call runs at most 10 minutes) while later calls poll it. The machine goes back after 30 s idle, taking
# every file with it: send every call (puts, install, start, polls) in one tool block, back to back.
#
#   bench/gpu_device.sh pack          # here, once: wheels + GGUF in parts (see that script)
#   bench/gpu_device.sh put | install # device calls, one per part
#   bench/gpu_proof_device.sh start [gpu_proof.py options]   # starts the proof, then polls 9 min
#   bench/gpu_proof_device.sh poll    # device calls after it: polls up to 9 min, copies the results to $OUT
#   bench/gpu_proof_device.sh probe   # once `start` has converted the model: the decode step probe
#
# --finish-within-min must also fit the session's device budget as the machine counts it (a machine of
# one chip may count half its held time, or all of it): at a full count keep it under budget_left_s / 60
# less 3.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/site SRC=/tmp/star-src GGUF=/tmp/star-gguf/SmolLM2-135M-Instruct.Q4_1.gguf
WORK=/tmp/star-proof RESULTS=/tmp/star-proof-out
PY=${PYTHON:-python3}  # the device's own Python; PYTHON=… for a check elsewhere

start() {
  [ -d "$SITE/vllm" ] && [ -f "$GGUF" ] || { echo "run bench/gpu_device.sh put … install first" >&2; exit 1; }
  bench/gpu_device.sh start "$PY" bench/gpu_proof.py --gguf "$GGUF" --work "$WORK" --out "$RESULTS" \
    --eval-batch 128 "$@"
  poll
}

poll() {
  bench/gpu_device.sh poll  # until the run ends or 9 minutes pass
  if [ -n "${OUT:-}" ]; then
    cp "$RESULTS"/gpu_proof.* "$OUT/" 2>/dev/null || true
    mv "$OUT/job.log" "$OUT/gpu_proof.log"  # the driver's log, as the run folders name it
    cp "$WORK/run/rl/metrics.jsonl" "$OUT/gpu_proof_rl_async.jsonl" 2>/dev/null || true
    cp "$WORK/run-sync/rl/metrics.jsonl" "$OUT/gpu_proof_rl_sync.jsonl" 2>/dev/null || true
    # what the policy wrote during RL, a few whole trajectories per step (rl.samples_per_step)
    [ -f "$WORK/run/rl/samples.jsonl" ] && gzip -c "$WORK/run/rl/samples.jsonl" > "$OUT/gpu_proof_rl_samples.jsonl.gz" || true
    # one archive (a call brings back at most 8 files, and a run with its sync baseline fills 7 others):
    # the services' logs, last 200 KB each (the rollout engine logs where its time goes every 30 s),
    # under logs/, and the held-out answers with their scores and trajectories (a few MB compressed),
    # under eval_sft/ and eval_rl/, to read what RL changed
    local pack=/tmp/star-proof-pack
    rm -rf "$pack" && mkdir -p "$pack/logs"
    for run in run run-sync; do
      for f in "$WORK/$run"/logs/{rollout-0,rollout-1,learner,sandbox,reward-0}.log; do
        [ -f "$f" ] && tail -c 200000 "$f" > "$pack/logs/${run}_$(basename "$f")"
      done
    done
    for phase in eval_sft eval_rl; do [ -d "$WORK/$phase" ] && ln -s "$WORK/$phase" "$pack/$phase"; done
    # rl.val_every: which versions were validated and how each scored, with each validation's log
    if [ -d "$WORK/run/validation" ]; then
      mkdir -p "$pack/validation"
      cp "$WORK/run/validation/history.json" "$pack/validation/" 2>/dev/null || true
      for f in "$WORK"/run/logs/validate-v*.log; do [ -f "$f" ] && tail -c 20000 "$f" > "$pack/validation/$(basename "$f")"; done
    fi
    tar -czhf "$OUT/gpu_proof_logs.tar.gz" -C "$pack" . 2>/dev/null || true
  fi
}

probe() {
  # the transformers engine's ms per decode step against HF's DynamicCache forward, same run
  cd "$SRC"
  PYTHONPATH=$SITE:$SRC PYTHONUNBUFFERED=1 "$PY" bench/decode.py --model "$WORK/smollm2-135m-instruct" \
    --step-probe --probe-batches 16,64,128 --prompt 3000 --probe-steps 32 --name decode_probe_slots 2>&1 \
    | grep -v 'it/s\]$' | tail -60
  cd - > /dev/null
  [ -n "${OUT:-}" ] && cp "$SRC"/bench/results/decode_probe_slots.* "$OUT/" || true
}

case "${1:-}" in
  poll|probe) "$1" ;;
  start) shift; start "$@" ;;
  *) echo "usage: $0 start [gpu_proof.py options] | poll | probe" >&2; exit 2 ;;
esac
