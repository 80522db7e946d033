#!/usr/bin/env bash
# The job behind this folder, on one nvidia-h100-x2 machine: `bench/gpu_device.sh start bash <this file>`.
# Ours with ZeRO-3 layer units (the default) and the plain baseline first, then one option changed at a time.
set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv
grep -m1 "model name" /proc/cpuinfo
L="python bench/learner_multigpu.py --nproc 2 --skip-baseline --recompute none --steps 6 --warmup 2"
$L --name lu_units --profile
python bench/learner_multigpu.py --nproc 2 --skip-ours --baseline-checkpointing on --steps 6 --warmup 2 --name lu_units
$L --name lu_nounits --layer-units off
$L --name lu_units_bf16 --grad-reduce bf16
NCCL_PROTO=Simple $L --name lu_units_simple
python -m pytest -q -x tests/learner/test_distributed.py -k gpus -p no:cacheprovider
