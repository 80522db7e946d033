"""What the RL stage checks around its publishing: notes on the recipe, said once before the loop
starts, and the services it cannot train without, probed before each publication."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.common.schemas import SamplingParams
from services.pipeline.config import PipelineConfig, sampling_cuts
from services.pipeline.external import ready
from services.pipeline.stage import Run, StageFailed, console
from services.reward.rewards import Curriculum

HEALTH_EVERY_S = 2.0


def off_policy_note(sampling: SamplingParams) -> str | None:
    """What rollout sampling the learner cannot follow means for training, or None when it can. The
    learner's log-probs are of softmax(logits / T) at the rollouts' temperature (rl.sampling passes
    it), but of the whole vocabulary: a top-p or top-k cut draws from another distribution, so its
    samples are off-policy for the policy trained."""
    cuts = sampling_cuts(sampling)
    if not cuts:
        return None
    return (
        f"rl.sampling samples with {' and '.join(cuts)}: the learner trains the whole distribution, so these "
        "samples are off-policy for it (top_p 1.0 and no top_k keep them on-policy)"
    )


def forced_turns_note(sampling: SamplingParams) -> str | None:
    """A warning that the episodes are forced to a fixed shape (a benchmarking option), or None."""
    f = sampling.forced_turns
    if f is None:
        return None
    if f.shape == "teacher":
        return (
            "rl.sampling.forced_turns (benchmarking): each episode's tool calls, turn and answer lengths are drawn "
            "from the teacher's trajectories, whatever the model samples: the run measures time, not learning"
        )
    return (
        f"rl.sampling.forced_turns (benchmarking): every episode is {f.tool_calls} tool turns of {f.turn_tokens} "
        f"tokens and an answer of {f.answer_tokens}, whatever the model samples: the run measures time, not learning"
    )


def unreached_stages_note(curriculum: Curriculum | None, epochs: int, steps: int) -> str | None:
    """Which curriculum stages start after the run's last epoch (or step, when the curriculum counts
    steps), or None when it reaches them all. A curriculum by epoch trains a run of an epoch or two on
    its first stages only."""
    if curriculum is None:
        return None
    if curriculum.unit == "epoch":
        last, length, hint = epochs, f"rl.epochs {epochs}", "rl.curriculum_unit step counts RL steps instead"
    else:
        last, length, hint = steps, f"the run's {steps} steps", "more rl.max_steps or rl.epochs reach them"
    late = [f"{kind}@{start}" for start, kind in curriculum.stages if start > last]
    if not late:
        return None
    reached = [kind for start, kind in curriculum.stages if start <= last]
    return (
        f"rl.curriculum stages {', '.join(late)} start after {length}: this run's reward is "
        f"{' then '.join(reached)} ({hint})"
    )


def external_fleet_note(config: PipelineConfig) -> str | None:
    """What of the recipe an external fleet does not take from it, or None: its sandbox injects the
    faults its own settings say."""
    if config.deployment.fleet != "external" or not config.rl.fault_rate:
        return None
    return (
        f"rl.fault_rate {config.rl.fault_rate:g} is not applied to an external fleet: its sandbox's "
        "STAR_FAULT_RATE decides"
    )


def notes(run: Run, curriculum: Curriculum | None, total_steps: int) -> list[str]:
    """The warnings the RL stage says before it starts, in order."""
    r = run.config.rl
    found = (
        forced_turns_note(r.sampling),
        off_policy_note(r.sampling),
        unreached_stages_note(curriculum, r.epochs, total_steps),
        external_fleet_note(run.config),
    )
    return [note for note in found if note]


@dataclass
class Dependencies:
    """Services the stage cannot train without, probed on /readyz every HEALTH_EVERY_S. While one
    is down no new step is published (a rollout against a dead sandbox scores 0, and that would be
    trained); down longer than `limit_s` (the recipe's controller.sandbox_down_limit_s), the stage fails,
    naming it. (A dead process is restarted by the supervisor meanwhile; this covers one that runs but
    does not answer.)"""

    urls: dict[str, str]
    limit_s: float
    down_since: dict[str, float] = field(default_factory=dict)
    checked_at: float = 0.0

    def check(self) -> list[str]:
        """The names down now (as of the last probe)."""
        now = time.monotonic()
        if now - self.checked_at >= HEALTH_EVERY_S:
            self.checked_at = now
            for name, url in self.urls.items():
                if ready(url):
                    if name in self.down_since:
                        console.print(f"{name} is back after {now - self.down_since.pop(name):.0f} s; publishing again")
                elif name not in self.down_since:
                    self.down_since[name] = now
                    console.print(f"[yellow]{name} at {url} is not ready: publishing paused[/]")
        for name, since in self.down_since.items():
            if now - since > self.limit_s:
                raise StageFailed(f"{name} at {self.urls[name]} has not been ready for {now - since:.0f} s")
        return list(self.down_since)
