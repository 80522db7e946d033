"""Fixtures of the learner tests: the tiny Qwen2 policy and scored trajectories sampled from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.schemas import Score, ScoredTrajectory


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from services.models import tiny_qwen2

    return tiny_qwen2()


def behaviour_logprobs(model_dir: Path, token_ids: list[list[int]]) -> list[list[float]]:
    """What a rollout engine would report: each token's logprob under the sampling policy."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in token_ids:
            logits = lm(torch.tensor([ids])).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
            out.append([0.0] + lp.tolist())
    return out


def scored_batch(
    model_dir: Path,
    groups: int,
    group_size: int,
    *,
    length: int = 24,
    prompt: int = 6,
    seed: int = 0,
    version: int = 0,
    run_id: str = "test",
    step: int | None = None,
) -> list[ScoredTrajectory]:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(100, 5000, (length,), generator=g).tolist() for _ in range(groups * group_size)]
    lps = behaviour_logprobs(model_dir, ids)
    rewards = torch.rand(groups * group_size, generator=g).mul(5).round(decimals=2).tolist()
    out = []
    for k, (tok, lp, r) in enumerate(zip(ids, lps, rewards)):
        grp, i = divmod(k, group_size)
        mask = [0] * prompt + [1] * (length - prompt)
        out.append(
            ScoredTrajectory(
                run_id=run_id,
                task_id=f"task-{seed}-{grp}",
                prompt_id=f"p-{seed}-{grp}",
                group_id=f"g-{seed}-{grp}",
                sample_index=i,
                policy_version=version,
                token_ids=tok,
                loss_mask=mask,
                logprobs=[None if m == 0 else v for m, v in zip(mask, lp)],
                finish_reason="answer",
                score=Score(),
                reward=r,
                step=step,
            )
        )
    return out


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Close the learner engines a test body made once it ends: DeepSpeed's hooks keep a dropped engine
    (about 150 MiB of the tiny policy's training state) alive for the rest of the session otherwise.
    Engines that fixtures made are theirs to keep."""
    from services.learner.engine import PolicyEngine

    made = []
    init = PolicyEngine.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    PolicyEngine.__init__ = recording_init
    try:
        return (yield)
    finally:
        PolicyEngine.__init__ = init
        for engine in made:
            engine.close()
