"""Per-step benchmark rates logged by the learner: means over the batch, check rates where they apply."""

from __future__ import annotations

from services.common.schemas import CheckVerdict, Score, ScoredTrajectory
from services.learner.trainer import score_rates


def _traj(success: float, cs_micro: float, finish: str = "answer", room: bool | None = None) -> ScoredTrajectory:
    score = Score(success=success, cs_micro=cs_micro, cs_macro=float(cs_micro == 1.0),
                  commonsense={"Within Sandbox": CheckVerdict(passed=cs_micro == 1.0)},
                  hard={"Room Type": CheckVerdict(passed=room)})
    return ScoredTrajectory(run_id="r", task_id="t", prompt_id="p", group_id="g", sample_index=0,
                            finish_reason=finish, score=score, reward=success)


def test_rates_are_batch_means_and_skip_checks_that_do_not_apply():
    rates = score_rates([_traj(1.0, 1.0, room=True), _traj(0.0, 0.5, room=None), _traj(0.0, 0.5, "format_error", False)])
    assert rates["success_rate"] == 1 / 3
    assert rates["cs_micro_rate"] == 2 / 3
    assert rates["answered_rate"] == 2 / 3
    assert rates["check/Within Sandbox"] == 1 / 3
    assert rates["check/Room Type"] == 0.5  # the None verdict does not count
    assert score_rates([]) == {}
