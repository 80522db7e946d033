#!/usr/bin/env bash
# One device job for issues 63 and 64, a lane per GPU (or group), each lane archived into
# bench/results/lane_<name>.tgz as it ends (started by `bench/gpu_device.sh start bash
# bench/results/runs/session_63_64/job.sh`, fetched by `bench/gpu_device.sh poll 'lane_*.tgz' 'lane/NAME/*'`; keep
# a poll in flight until the job ends, the machine goes back after 30 s without a call):
#   learner63 (LEARNER_GPU, default 0): issue 63 item 6, bench/learner_packed.py on one H200 capped at 80 GiB
#             (1.5B, ours on one 16K row, ours on the recipe's packed rows, HF + Liger; about 6-8 minutes), then
#             kernels63 on the same GPU: issue 63 item 2's attention figures and the GPU tests
#   recipe64  (RECIPE_GPUS): issue 64, the 1.5B recipe (its engineer fills recipe64); limit64: the agent loop at
#             256 agents against both ceilings
#   grads63   (LEARNER_GPU): issue 63, the attention gradients against fp64 (also the first part of kernels63)
#   mem63     (LEARNER_GPU): issue 63, memory per layer at 7B width (bench/layer_memory.py)
#   peer66    (PEER_GPU): issue 66, bench/peer_trl.py (TRL beside star train), alone on its GPU
# By default both run one after another on GPU 0 (one H200); on two GPUs LANES="learner63 recipe64" RECIPE_GPUS=1
# runs them side by side. LEARNER_ARGS adds
# bench/learner_packed.py arguments (e.g. --steps 30), LEARNER_TIMEOUT_S bounds the lane (default 600).
set -u
source bench/gpu_lanes.sh  # lane, pack, mirror; R=bench/results
LANES=${LANES:-"learner63+recipe64+kernels63"}
# the records carry the card they ran on: learner_packed_h200 on an H200, learner_packed_h100 on an H100
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -q H100 && echo h100 || echo h200)
# extra wheels beside the vLLM ones: liger-kernel (.diag/whl/liger_kernel-0.8.5-py3-none-any.whl, pure Python;
# its Triton is the device torch's), onto the PYTHONPATH that `bench/gpu_device.sh start` sets (/tmp/site)
[ -d .diag/whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .diag/whl/*.whl

learner63() {
  # the record is rewritten after each side: `poll 'lane/learner63/*'` brings back what is done so far
  mirror learner63 $R/learner_packed_$CARD.json $R/learner_packed_$CARD.md
  lane learner63 ${LEARNER_GPU:-0} timeout ${LEARNER_TIMEOUT_S:-600} python bench/learner_packed.py \
    --name learner_packed_$CARD ${LEARNER_ARGS:-}
  mirror_stop
  nvidia-smi > $R/lane/learner63/nvidia-smi.txt 2>&1
  pack learner63 $R/learner_packed_$CARD.* $R/learner_packed_${CARD}_profile.txt
}

# ==== grads63: every kernel's gradients and the packed paths' against fp64, whether cuDNN's depend on the first
# layout met, and per-sequence attention after its plan warm-up in a fresh process (about a minute) ====
grads63() {
  lane kernels63_grads ${LEARNER_GPU:-0} timeout 150 python bench/attention_grads.py --out $R/lane/kernels63_grads
  pack grads63 $R/lane/kernels63_grads
}

# ==== mem63: issue 63 item 3, the learner's memory per layer at 7B width on one GPU capped at 80 GiB (2 and 4
# layers, each memory option; about 4 minutes): bench/layer_memory.py ====
mem63() {
  lane mem63 ${LEARNER_GPU:-0} timeout ${MEM_TIMEOUT_S:-360} python bench/layer_memory.py ${MEM_ARGS:-}
  pack mem63 $R/layer_memory_7b.*
}

# ==== kernels63: issue 63 items 2-4 on the GPU: packed attention at both widths (50 passes, fresh lengths),
# and the GPU tests of the recompute fix, the GQA-native varlen and the lean activations ====
kernels63() {
  # the tests' tiny models take the Qwen2.5 tokenizer from var/models (the device builds none): the carried .qwen-tok
  mkdir -p var/models && rm -rf var/models/qwen2.5-tokenizer && cp -r .qwen-tok var/models/qwen2.5-tokenizer
  lane kernels63_tests ${LEARNER_GPU:-0} timeout ${KERNEL_TESTS_TIMEOUT_S:-150} python -m pytest -q -s -p no:cacheprovider \
    tests/learner/test_engine_recompute.py tests/learner/test_attention_gqa.py tests/learner/test_fused_layers.py \
    tests/learner/test_packed_attention.py tests/learner/test_attention_grads_gpu.py
  grads63
  local width
  for width in ${KERNEL_WIDTHS:-1p5b 7b}; do  # KERNEL_WIDTHS picks the widths, in order
    case $width in
      1p5b) set -- --hidden 1536 --heads 12 --kv-heads 2 --intermediate 8960 --lengths 12000,9000,11768 ;;
      7b) set -- ;;
    esac
    lane kernels63_$width ${LEARNER_GPU:-0} timeout ${KERNEL_BENCH_TIMEOUT_S:-240} python bench/packed_attention.py \
      --fresh-lengths --warmup 2 --repeat 50 --name packed_attention_gqa_$width "$@"
  done
  pack kernels63 $R/packed_attention_gqa_* $R/lane/kernels63_tests $R/lane/kernels63_grads $R/lane/kernels63_1p5b $R/lane/kernels63_7b
}
# ==== end of kernels63 ====

# ==== recipe64: issue 64 (the 1.5B recipe), its engineer owns and fills this function ====
# `star train configs/qwen2.5-1.5b-arpo-macro.yaml` on one GPU (bench/recipe_1p5b.py): random-init 1.5B, the teacher's
# episode shapes, 4 prompts x 8 a step, variant on (deadlines + over-sampling) for 10 steps, the closed-loop ceiling,
# then variant off for the steps the budget leaves (RECIPE_BUDGET_S, default 690 s; both with 10 steps: about 860 s;
# RECIPE_NAME names the record, RECIPE_ARGS adds arguments).
# Needs .qwen-tok carried. Brings back bench/results/recipe_1p5b_h200.{json,md,png} and the runs' logs.
recipe64() {
  local w=/tmp/recipe-1p5b name=${RECIPE_NAME:-recipe_1p5b_$CARD}  # the record's name (another card: say so)
  mirror recipe64 $R/$name.json $R/$name.md $w/run-on/rl/metrics.jsonl $w/run-off/rl/metrics.jsonl
  lane recipe64 ${RECIPE_GPUS:-0} timeout ${RECIPE_TIMEOUT_S:-720} python bench/recipe_1p5b.py --tokenizer .qwen-tok \
    --work $w --budget-s ${RECIPE_BUDGET_S:-690} --name $name ${RECIPE_ARGS:-}
  mirror_stop
  mkdir -p /tmp/r64/logs
  for v in on off; do
    cp $w/train-$v.log /tmp/r64/ 2>/dev/null; cp $w/run-$v/rl/metrics.jsonl /tmp/r64/metrics-$v.jsonl 2>/dev/null
    cp $w/run-$v/rl/journal.jsonl /tmp/r64/journal-$v.jsonl 2>/dev/null
    for f in $w/run-$v/logs/{rollout-0,learner,sandbox,reward-0,reward-1}.log; do
      [ -f "$f" ] && tail -c 200000 "$f" > /tmp/r64/logs/$v-$(basename "$f"); done
  done
  cp $w/ceiling.json /tmp/r64/ 2>/dev/null
  nvidia-smi > /tmp/r64/nvidia-smi.txt 2>&1
  pack recipe64 $R/$name.* /tmp/r64
}
# limit64 (about 6 minutes): issue 64 item 4, bench/rollout_limit.py at 256 agents, 3 interleaved runs a side, the
# closed-loop ceiling beside the open-loop one, tool waits from the sandbox's latency
limit64() {
  lane limit64 ${RECIPE_GPUS:-0} timeout ${LIMIT64_TIMEOUT_S:-420} python bench/rollout_limit.py --runs 1.5b=256 \
    --updates '' --repeats 3 --name rollout_limit_256_closed
  pack limit64 $R/rollout_limit_256_closed.*
}
# ==== end of recipe64 ====

# ==== peer66: issue 66, TRL's GRPOTrainer beside star train (bench/peer_trl.py; 24 minutes of an H200 with
# each side capped at 9 minutes of RL, PEER_SIDE_MIN).
# Needs the pack with PEER_PACKAGES (TRL and its wheels, bench/gpu_device.sh) and the GGUF; run it first, alone on
# its GPU: LANES="peer66+learner63" (then learner63 with LEARNER_TIMEOUT_S=480 for the compiled Liger side) ====
peer66() {
  mirror peer66 $R/peer_trl.json $R/peer_trl.md /tmp/star-peer/state.json /tmp/star-peer/trl/trl.log
  lane peer66 ${PEER_GPU:-0} timeout ${PEER_TIMEOUT_S:-1560} python bench/peer_trl.py \
    --gguf /tmp/star-gguf/SmolLM2-135M-Instruct.Q4_1.gguf --work /tmp/star-peer --trl-python python3 \
    --steps ${PEER_STEPS:-40} --heldout ${PEER_HELDOUT:-100} --side-minutes ${PEER_SIDE_MIN:-9} ${PEER_ARGS:-}
  mirror_stop
  nvidia-smi > $R/lane/peer66/nvidia-smi.txt 2>&1
  # the phases' state and logs (a failed phase names its log), each log's tail
  local w=/tmp/star-peer d=$R/lane/peer66/work f
  mkdir -p $d && cp $w/state.json $w/trl/spec.json $w/trl/side.json $d/ 2>/dev/null
  for f in $w/logs/*.log $w/trl/trl.log $w/trl/logs/*.log $w/run/logs/*.log $w/eval_*/*.log; do
    [ -f "$f" ] && tail -c 300000 "$f" > $d/$(basename $(dirname $f))-$(basename $f); done
  cp $w/run/rl/metrics.jsonl $d/ 2>/dev/null
  pack peer66 $R/peer_trl.*
}
# ==== end of peer66 ====

nvidia-smi --query-gpu=index,name,memory.total --format=csv
for group in $LANES; do
  ( IFS=+; set -- $group; IFS=$' \t\n'; for l in "$@"; do $l; done ) &
done
wait
echo "[$(date +%T)] all lanes ended"
