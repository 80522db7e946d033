"""kill -9 each kind of worker in the middle of a real CPU RL stage: the controller restarts it, the
stage finishes, and every task's G trajectories are scored once and trained once (counted by id).

Each fault waits for the moment its victim holds work (a delivered, unacknowledged message in its
consumer group) so the kill lands mid-message, not between messages."""

from __future__ import annotations

import pytest

from tests.reliability.chaos import (
    ChaosContext,
    ChaosRun,
    assert_nothing_lost_or_trained_twice,
    group_pending,
    kill_group,
    learner_checkpoint_state,
    tiny_rl_config,
)

pytestmark = pytest.mark.slow


def kill_rollout(ctx: ChaosContext) -> str | None:
    # mid-task: a task delivered to the rollout group and not yet acknowledged, after step 1
    if not ctx.wait_for(
        lambda: ctx.version() >= 1 and group_pending(ctx.client, ctx.names.tasks, "rollout") > 0, timeout=240
    ):
        return None
    victim = ctx.worker("rollout")
    kill_group(victim.proc.pid)
    return f"killed {victim.name} (pid {victim.proc.pid}) holding a task"


def kill_reward(ctx: ChaosContext) -> str | None:
    if not ctx.wait_for(
        lambda: group_pending(ctx.client, ctx.names.trajectories, "reward") > 0, timeout=240, poll=0.002
    ):
        return None
    victim = ctx.worker("reward")
    kill_group(victim.proc.pid)
    return f"killed {victim.name} (pid {victim.proc.pid}) holding a trajectory"


def kill_learner(ctx: ChaosContext) -> str | None:
    # after the first checkpoint, while it holds the next step's scored messages
    if not ctx.wait_for(
        lambda: ctx.version() >= 1 and group_pending(ctx.client, ctx.names.scored, "learner") > 0,
        timeout=240,
        poll=0.05,
    ):
        return None
    pid = ctx.fleet.learner.proc.pid
    kill_group(pid)
    return f"killed the learner (pid {pid}) holding step-2 messages at version {ctx.version()}"


FAULTS = {
    "rollout": (kill_rollout, "rollout-0"),
    "reward": (kill_reward, "reward-0"),
    "learner": (kill_learner, "learner"),
}


@pytest.mark.parametrize("kind", list(FAULTS))
def test_kill_9_mid_run_loses_nothing_and_trains_nothing_twice(kind, star_home, tmp_path, monkeypatch):
    from services.controller.train import train

    fault, restarted = FAULTS[kind]
    chaos = ChaosRun(fault)
    chaos.install(monkeypatch)
    folder = tmp_path / "run"
    train(tiny_rl_config(f"kill-{kind}"), folder)

    assert chaos.error is None, chaos.error
    assert chaos.events, f"the {kind} fault never found its moment"
    print(chaos.events, chaos.restarts)
    assert chaos.restarts[restarted] >= 1, chaos.restarts
    assert chaos.ledger is not None
    assert_nothing_lost_or_trained_twice(folder, chaos.ledger)
    if kind == "learner":
        log = (folder / "logs" / "learner.log").read_text()
        # two learner processes wrote to the log; the second started from the step-1 checkpoint
        assert log.count('"state": "finished"') == 1
        assert learner_checkpoint_state(folder / "rl")["step"] == 3
