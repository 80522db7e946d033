"""Weights from the learner to the rollout fleet: one version's manifest and every transport's two sides.

`manifest.py` is a published version's folder and its manifest, written and checked in one place, with
the one `WeightsError`; `buckets.py` the order and groups parameters are sent in; then one module per
transport, each with its sending (learner) and receiving (rollout) side: `files.py` (the weights store),
`nccl.py` (broadcast into live vLLM engines) and `cuda_ipc.py` (colocated engines on the learner's GPUs);
`digests.py` proves a sync complete, tensor by tensor.
"""
