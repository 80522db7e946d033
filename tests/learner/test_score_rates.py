"""Per-step benchmark rates logged by the learner: means over the batch, check rates where they apply."""

from __future__ import annotations

from services.common.schemas import CheckVerdict, Score, ScoredTrajectory
from services.learner.trainer import rollout_timings, score_rates


def _traj(success: float, cs_micro: float, finish: str = "answer", room: bool | None = None) -> ScoredTrajectory:
    score = Score(
        success=success,
        cs_micro=cs_micro,
        cs_macro=float(cs_micro == 1.0),
        commonsense={"Within Sandbox": CheckVerdict(passed=cs_micro == 1.0)},
        hard={"Room Type": CheckVerdict(passed=room)},
    )
    return ScoredTrajectory(
        run_id="r",
        task_id="t",
        prompt_id="p",
        group_id="g",
        sample_index=0,
        finish_reason=finish,
        score=score,
        reward=success,
    )


def test_rates_are_batch_means_and_skip_checks_that_do_not_apply():
    rates = score_rates(
        [_traj(1.0, 1.0, room=True), _traj(0.0, 0.5, room=None), _traj(0.0, 0.5, "format_error", False)]
    )
    assert rates["success_rate"] == 1 / 3
    assert rates["cs_micro_rate"] == 2 / 3
    assert rates["answered_rate"] == 2 / 3
    assert rates["check/Within Sandbox"] == 1 / 3
    assert rates["check/Room Type"] == 0.5  # the None verdict does not count
    assert score_rates([]) == {}


def test_rollout_timings_are_episode_means_and_the_slowest_episode():
    a, b, c = (_traj(1.0, 1.0) for _ in range(3))
    a.timings = {"total_s": 10.0, "generate_s": 8.0, "tool_s": 1.0}
    b.timings = {"total_s": 30.0, "generate_s": 20.0, "tool_s": 3.0}
    # c has no timings (an older worker): it is left out, not counted as zero
    out = rollout_timings([a, b, c])
    assert out["rollout/total_s_mean"] == 20.0 and out["rollout/total_s_max"] == 30.0
    assert out["rollout/tool_s_mean"] == 2.0
    assert "rollout/turns_mean" not in out and "scoring/score_s_mean" not in out
    a.timings["score_s"], b.timings["score_s"] = 0.5, 1.5  # the scorer's seconds, beside the episode's
    assert rollout_timings([a, b])["scoring/score_s_max"] == 1.5
    assert rollout_timings([c]) == {}


def test_step_samples_take_each_groups_first_sample_whatever_its_reward():
    from services.learner.trainer import step_samples

    trajs = []
    for group, rewards in (("g1", [5.0, 0.0, 2.0]), ("g2", [0.0, 4.0, 1.0]), ("g3", [3.0, 3.0, 3.0])):
        for i in (2, 0, 1):  # arrival order is not sample order
            t = _traj(0.0, 1.0)
            t.group_id, t.sample_index, t.reward, t.reward_kind = group, i, rewards[i], "macro"
            t.messages = [{"role": "assistant", "content": f"{group}/{i}"}]
            trajs.append(t)
    picked = step_samples(trajs, 2)
    assert [(s["group_id"], s["sample_index"], s["reward"]) for s in picked] == [("g1", 0, 5.0), ("g2", 0, 0.0)]
    assert picked[1]["messages"] == [{"role": "assistant", "content": "g2/0"}]
    assert (picked[0]["reward_kind"], picked[0]["epoch"]) == ("macro", 1)  # which reward `reward` is
    assert step_samples(trajs, 0) == [] and len(step_samples(trajs, 10)) == 3
