#!/usr/bin/env bash
# One 4-GPU device job, a lane per GPU (or pair), each lane archived into bench/results/lane_<name>.tgz as it
# ends (started by `bench/gpu_device.sh start bash bench/results/runs/session_x4b/job.sh`, fetched by
# `bench/gpu_device.sh poll 'lane_*.tgz' 'lane/NAME/*'`, the second bringing back a running lane's log and what it
# mirrors; keep a poll in flight until the job ends, the machine goes back after 30 s without a call):
#   GPU 0:   the proof recipe (SFT → RL → held-out evaluation), configs/smollm2-proof.yaml as it is now
#   GPU 1:   Gemma 3 on vLLM against the learner (bench/model_families.py), then bench/rollout_limit.py at
#            256 agents: the defaults again (run-to-run spread) and engine variants
#   GPU 2-3: weight sync across network namespaces over NCCL's socket transport (bench/weight_sync_hosts.py),
#            then the learner at the recipe's packed rows against HF + Liger (bench/learner_multigpu.py)
# On fewer GPUs: LANES picks the lanes (default: all four), and PROOF_GPU, FAMILIES_GPU, LIMIT_GPU, SYNC_GPUS and
# CHAOS_GPUS the devices, e.g. LANES="proof families" FAMILIES_GPU=0 on one GPU. Lanes joined by "+" run one
# after another on the same GPUs, e.g. LANES="sync_threads+chaos+learner" SYNC_GPUS=0,1 CHAOS_GPUS=0,1 on two.
set -u
source bench/gpu_lanes.sh  # lane, pack; R=bench/results
LANES=${LANES:-"proof families_limit sync_learner"}
GGUF=/tmp/star-gguf/SmolLM2-135M-Instruct.Q4_1.gguf
# extra wheels (pyroute2, liger-kernel) beside the vLLM ones
[ -d .diag/whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .diag/whl/*.whl
proof() {
  # the report (written after each evaluation) and the RL metrics, as they grow: `poll 'lane/proof/*'`
  mirror proof /tmp/star-proof-out/gpu_proof.json /tmp/star-proof-out/gpu_proof.md /tmp/star-proof/run/rl/metrics.jsonl
  # PROOF_MIN (the run's deadline, minutes), PROOF_TIMEOUT_S (the lane's) and PROOF_ARGS (e.g. --set rl.max_steps=80)
  lane proof ${PROOF_GPU:-0} timeout ${PROOF_TIMEOUT_S:-1580} python bench/gpu_proof.py --gguf $GGUF --work /tmp/star-proof \
    --out /tmp/star-proof-out --eval-batch 128 --phases convert,sft,eval_sft,rl_async,eval_rl,report \
    --finish-within-min ${PROOF_MIN:-25.8} ${PROOF_ARGS:-}
  mirror_stop
  mkdir -p /tmp/pp/logs && cp /tmp/star-proof-out/gpu_proof.* /tmp/pp/ 2>/dev/null
  cp /tmp/star-proof/run/rl/metrics.jsonl /tmp/pp/gpu_proof_rl_async.jsonl 2>/dev/null
  for f in /tmp/star-proof/run/logs/{rollout-0,learner,sandbox,reward-0}.log; do
    [ -f "$f" ] && tail -c 200000 "$f" > /tmp/pp/logs/$(basename "$f"); done
  pack proof /tmp/pp
}
families() {
  lane families ${FAMILIES_GPU:-1} timeout 300 python bench/model_families.py --gpu --families gemma3 --tokenizers .diag/family_tokenizers.tar.xz
  pack families $R/model_families.json
}
limit() {
  local v
  for v in default block64 full; do
    case $v in
      default) set -- ;;
      block64) set -- --vllm-set 'extra={"block_size":64}' ;;
      full) set -- --vllm-set cudagraph_mode=FULL ;;
    esac
    lane limit_$v ${LIMIT_GPU:-1} timeout 330 python bench/rollout_limit.py --runs 1.5b=256 --updates '' --name rollout_limit_256_$v "$@"
  done
  pack limit $R/rollout_limit_256_*
}
families_limit() { families; limit; }
# issue 47's whole table with the engine's defaults as they are now: 1.5B at 64, 256 and 512 agents with reloads in
# both in-flight modes, 7B at 512 (64 and 256: rollout_limit_7b.json, 0.97-0.98), then 1.5B at 256 again for the
# spread (about 20 minutes on an H200)
limit_all() {
  # each part packed as it ends, so a poll brings back what is done if the machine goes
  lane limit_all ${LIMIT_GPU:-1} timeout 600 python bench/rollout_limit.py --name rollout_limit
  pack limit_all $R/rollout_limit.*
  lane limit_7b ${LIMIT_GPU:-1} timeout 600 python bench/rollout_limit.py --runs 7b=512 --updates '' --steady-tokens 0 \
    --name rollout_limit_7b_512
  pack limit_7b $R/rollout_limit_7b_512.*
  lane limit_again ${LIMIT_GPU:-1} timeout 330 python bench/rollout_limit.py --runs 1.5b=256 --updates '' \
    --name rollout_limit_256_again
  pack limit_again $R/rollout_limit_256_again.*
}
# 1.5B at 256 agents with the engines sized for 256 sequences and for vLLM's default on the card (1,024 on an
# H200, what the fleet gets), back to back on one GPU and twice (about 13 minutes on an H200)
# max_num_seqs at 256 agents: the load itself, a rollout worker's own size on an H200 at 1.5B (its episode
# budget, 443: services/rollout/capacity.py engine_for_budget) and vLLM's default for the card
limit_seqs() {
  local round seqs
  for round in $(seq 1 ${SEQS_ROUNDS:-2}); do
    for seqs in 256 443 1024; do
      lane limit_seqs${seqs}_$round ${LIMIT_GPU:-1} timeout 330 python bench/rollout_limit.py --runs 1.5b=256 --updates '' \
        --vllm-set max_num_seqs=$seqs --name rollout_limit_256_seqs${seqs}_$round
      pack limit_seqs${seqs}_$round $R/rollout_limit_256_seqs${seqs}_$round.*
    done
  done
}
sync() {
  lane sync ${SYNC_GPUS:-2,3} timeout 540 python bench/weight_sync_hosts.py --shapes 1.5b,7b --load-seconds ${LOAD_S:-40}
  pack sync $R/weight_sync_hosts.*
}
learner() {
  lane learner ${SYNC_GPUS:-2,3} timeout 420 python bench/learner_multigpu.py --nproc 2 --shape 1.5b --rows recipe --name learner_recipe
  # Liger's compiled loss failed on the device before (InternalTorchDynamoError): then the side again, eager
  python -c "import json,sys; s=json.load(open('$R/learner_recipe.json'))['sides'].get('liger') or {}; sys.exit(0 if s.get('error') else 1)" \
    && lane learner_liger_eager ${SYNC_GPUS:-2,3} timeout 240 python bench/learner_multigpu.py --nproc 2 --shape 1.5b \
      --rows recipe --name learner_recipe --sides liger --liger-compile off --merge
  pack learner $R/learner_recipe* $R/lane/learner_liger_eager
}
sync_learner() { sync; learner; }
# What this session's device time did not reach (run alone: each takes a whole 4-GPU machine, or its
# two halves), in the order of the issues: the 7B recipe through `star train` (carry .qwen-tok, written
# here by `python -c "from services.models import qwen_tokenizer; qwen_tokenizer('.qwen-tok')"`), the
# learner at 7B, chaos on the NCCL path, and the socket sync with more connections.
# RECIPE_GPUS (default 0,1,2,3), RECIPE_NAME (the record's name), RECIPE_ARGS (more bench/recipe_7b.py arguments)
recipe7b() {
  local gpus=${RECIPE_GPUS:-0,1,2,3} name=${RECIPE_NAME:-recipe_7b}
  local n=$(( $(tr -cd , <<<"$gpus" | wc -c) + 1 ))
  lane recipe7b $gpus timeout ${RECIPE_TIMEOUT_S:-1500} python bench/recipe_7b.py --gpus $n --steps ${RECIPE_STEPS:-5} \
    --tokenizer .qwen-tok --name $name ${RECIPE_ARGS:-}
  # cut short by its timeout: the record of the steps it did train
  [ -f $R/$name.json ] || lane recipe7b_record $gpus python bench/recipe_7b.py --gpus $n --steps ${RECIPE_STEPS:-5} \
    --name $name --record-only ${RECIPE_ARGS:-}
  mkdir -p /tmp/r7/logs && cp /tmp/recipe-7b/run/rl/metrics.jsonl /tmp/recipe-7b/run/rl/journal.jsonl \
    /tmp/recipe-7b/train.log /tmp/r7/ 2>/dev/null
  for f in /tmp/recipe-7b/run/logs/*.log; do [ -f "$f" ] && tail -c 300000 "$f" > /tmp/r7/logs/$(basename "$f"); done
  nvidia-smi > /tmp/r7/nvidia-smi.txt 2>&1
  pack recipe7b $R/$name.* $R/lane/recipe7b_record /tmp/r7
}
learner7b() {
  lane learner7b 0,1,2,3 timeout ${LEARNER7B_TIMEOUT_S:-600} python bench/learner_multigpu.py --nproc 4 --shape 7b --rows recipe --name learner_recipe_7b
  pack learner7b $R/learner_recipe_7b*
}
chaos() {
  lane chaos ${CHAOS_GPUS:-0,1,2,3} timeout ${CHAOS_TIMEOUT_S:-1200} python bench/chaos.py gpu --parallel ${CHAOS_ARGS:-}
  pack chaos $R/chaos_gpu.*
}
sync_threads() {
  lane sync_threads ${SYNC_GPUS:-2,3} timeout 420 python bench/weight_sync_hosts.py --shapes 7b --methods nccl,files \
    --load-seconds 0 --socket-threads 4 --socks-per-thread 4 --name weight_sync_hosts_4x4
  pack sync_threads $R/weight_sync_hosts_4x4.*
}
nvidia-smi --query-gpu=index,name,memory.total --format=csv
for group in $LANES; do
  ( IFS=+; set -- $group; IFS=$' \t\n'; for l in "$@"; do $l; done ) &
done
wait
echo "[$(date +%T)] all lanes ended"
