#!/usr/bin/env bash
# The job behind this folder, on one nvidia-h100-x2 machine: `bench/gpu_device.sh start bash <this file>`.
# NCCL's protocols alone, then ours (ZeRO-3 layer units) with one communication option changed at a time.
set -x
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
python bench/nccl_protocols.py --nproc 2
L="python bench/learner_multigpu.py --nproc 2 --skip-baseline --recompute none --steps 8 --warmup 2"
$L --name lk_units
NCCL_PROTO=Simple $L --name lk_simple
NCCL_PROTO=^LL $L --name lk_noll
$L --name lk_reuse --reuse-distance 5000
$L --name lk_persist --persistence 5000
NCCL_PROTO=Simple $L --name lk_simple_reuse --reuse-distance 5000
python bench/learner_multigpu.py --nproc 2 --skip-ours --baseline-checkpointing on --steps 8 --warmup 2 --name lk_units
PYTHONPATH=$PYTHONPATH:$PWD/.pylib python -m pytest -q -x tests/learner/test_distributed.py -k gpus -p no:cacheprovider
