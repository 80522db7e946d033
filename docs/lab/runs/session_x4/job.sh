#!/usr/bin/env bash
# One 4-GPU device job, a lane per GPU, each lane archived into bench/results/lane_<name>.tgz as it ends
# (started by `bench/gpu_device.sh start bash bench/results/runs/session_x4/job.sh`, fetched by
# `bench/gpu_device.sh poll 'lane_*.tgz'`):
#   0: the proof recipe (SFT → RL → held-out evaluation) with the current rollout
#   1: bench/rollout_limit.py at 1.5B (64, 256, 512 agents; reloads every 10 s at 256 in both modes)
#   2: bench/rollout_limit.py at 7B (64, 256 agents)
#   3: bench/model_families.py --gpu, then bench/colocate_gpu.py (levels 1 and 2)
set -u
source bench/gpu_lanes.sh  # lane, pack; R=bench/results
GGUF=/tmp/star-gguf/SmolLM2-135M-Instruct.Q4_1.gguf
proof() {
  lane proof 0 timeout 1140 python bench/gpu_proof.py --gguf $GGUF --work /tmp/star-proof --out /tmp/star-proof-out \
    --eval-batch 128 --phases convert,sft,eval_sft,rl_async,eval_rl,report --finish-within-min 18
  mkdir -p /tmp/pp/logs && cp /tmp/star-proof-out/gpu_proof.* /tmp/pp/ 2>/dev/null
  cp /tmp/star-proof/run/rl/metrics.jsonl /tmp/pp/gpu_proof_rl_async.jsonl 2>/dev/null
  for f in /tmp/star-proof/run/logs/{rollout-0,rollout-1,learner,sandbox,reward-0}.log; do
    [ -f "$f" ] && tail -c 200000 "$f" > /tmp/pp/logs/$(basename "$f"); done
  pack proof /tmp/pp
}
limit15() {
  lane limit15 1 timeout 720 python bench/rollout_limit.py --name rollout_limit
  pack limit15 $R/rollout_limit.*
}
limit7() {
  lane limit7 2 timeout 600 python bench/rollout_limit.py --runs '7b=64,256' --updates '' --steady-tokens 0 --name rollout_limit_7b
  pack limit7 $R/rollout_limit_7b.*
}
families_colocate() {
  lane families 3 timeout 420 python bench/model_families.py --gpu --tokenizers .diag/family_tokenizers.tar.xz
  pack families $R/model_families.* docs/models.md
  lane colocate 3 timeout 300 python bench/colocate_gpu.py
  lane colocate2 3 timeout 300 python bench/colocate_gpu.py --level 2 --out $R/colocate_gpu_level2.json
  pack colocate $R/colocate_gpu*.json $R/lane/colocate2
}
nvidia-smi --query-gpu=index,name,memory.total --format=csv
proof & limit15 & limit7 & families_colocate &
wait
echo "[$(date +%T)] all lanes ended"
