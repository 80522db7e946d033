# Lanes of a multi-GPU device job (sourced by the job scripts under bench/results/runs/): each lane runs
# a command on its own GPUs with its log under bench/results/lane/NAME, and is archived into
# bench/results/lane_NAME.tgz when it ends, for `bench/gpu_device.sh poll 'lane_*.tgz'`.
R=bench/results
lane() {  # lane NAME GPUS CMD...
  local name=$1 gpu=$2; shift 2
  mkdir -p $R/lane/$name
  # the command's status is taken before `date` runs in the next echo (its substitution would reset $?)
  ( export CUDA_VISIBLE_DEVICES=$gpu; echo "[$(date +%T)] lane $name on GPU $gpu: $*"; "$@"; rc=$?
    echo "[$(date +%T)] lane $name rc=$rc" ) \
    > $R/lane/$name/lane.log 2>&1
}
pack() {  # pack NAME FILES...: the lane's log and files into one archive
  local name=$1; shift
  tar -czf $R/lane_$name.tgz $R/lane/$name "$@" 2>/dev/null
  echo "[$(date +%T)] packed lane $name"
}
mirror() {  # mirror NAME FILE...: copies the files into the lane's folder every 20 s until `mirror_stop`, so a
            # poll of 'lane/NAME/*' brings back what a long lane has so far if the machine goes before it ends
  local name=$1; shift
  mkdir -p $R/lane/$name
  ( while sleep 20; do cp "$@" $R/lane/$name/ 2>/dev/null; done ) &
  MIRROR_PID=$!
}
mirror_stop() { [ -n "${MIRROR_PID:-}" ] && kill "$MIRROR_PID" 2>/dev/null; MIRROR_PID=; }
