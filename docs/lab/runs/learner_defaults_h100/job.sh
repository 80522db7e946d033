#!/usr/bin/env bash
# The job behind this folder, on one nvidia-h100-x2 machine: `bench/gpu_device.sh start bash <this file>`.
# The committed record (ours on the learner's defaults, then the plain baseline in processes of its own,
# NCCL's own protocol), then ours with one default undone at a time.
set -x
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
L="python bench/learner_multigpu.py --nproc 2 --recompute none --steps 8 --warmup 2"
$L --skip-baseline --name learner_multigpu --profile
python bench/learner_multigpu.py --nproc 2 --skip-ours --baseline-checkpointing on --steps 8 --warmup 2 --name learner_multigpu
$L --skip-baseline --name ld_sharded --persist-gib 0
$L --skip-baseline --name ld_ncclproto --nccl-proto nccl
