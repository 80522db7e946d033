"""Parity: for the same plan, the episode API's reward and verdicts are `star score`'s, in both modes, over the
test data's train queries with their gold plans and with each plan broken one constraint at a time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.reward.evaluator import Evaluator
from services.reward.scoring import Scorer, ScoreRequest
from services.sandbox.world import World
from tests.support.episode_plans import plan_cases

pytestmark = pytest.mark.travelplanner_data
MODES = ("official", "strict")


@pytest.fixture(scope="module")
def scorer(official_world_url):
    world = World(official_world_url)
    scorer = Scorer(Evaluator(world))
    yield scorer
    scorer.close()
    world.close()


@pytest.fixture(scope="module")
def cases(travelplanner_dir):
    return plan_cases(travelplanner_dir)


def test_every_break_fails_its_check_and_every_gold_plan_passes(cases, scorer):
    assert sum(c.gold for c in cases) >= 15 and len({c.breaks for c in cases}) >= 6
    for case in cases:
        for mode in MODES:
            score = scorer.score(ScoreRequest(query=case.query, plan=case.plan, mode=mode)).score
            verdicts = score.commonsense | score.hard
            if case.gold:
                assert score.success == 1, (case.name, mode)
            else:
                assert verdicts[case.breaks].passed is False, (case.name, mode, case.breaks)


@pytest.mark.parametrize("reward", ["sum", "success"])
def test_the_episode_reward_is_the_scorers_in_both_modes(episode_server, cases, scorer, reward):
    with episode_server.client() as client:
        for case in cases:
            for mode in MODES:
                start = {"query": case.query} if case.query_changed else {"query_id": case.query_id, "split": "train"}
                ep = client.start(**start, reward=reward, mode=mode)
                result = client.finish(ep.episode_id, plan=case.plan)
                for m in MODES:
                    expected = scorer.score(ScoreRequest(query=case.query, plan=case.plan, mode=m, reward=reward))
                    got = result.verdicts[m]
                    assert got.commonsense == expected.score.commonsense and got.hard == expected.score.hard, case.name
                    assert result.scores[m].rewards == expected.rewards, (case.name, m)
                    if m == mode:
                        assert result.reward == expected.reward, (case.name, m)


def test_the_episode_reward_is_star_scores_output(episode_server, cases, official_world_url, tmp_path):
    case = next(c for c in cases if c.breaks == "is_valid_attractions")
    (tmp_path / "q.json").write_text(json.dumps(case.query))
    (tmp_path / "p.json").write_text(json.dumps(case.plan))
    with episode_server.client() as client:
        ep = client.start(query_id=case.query_id, split="train", reward="sum", mode="official")
        result = client.finish(ep.episode_id, plan=case.plan)
    for mode in MODES:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cli",
                "score",
                "--query",
                str(tmp_path / "q.json"),
                "--plan",
                str(tmp_path / "p.json"),
                "--mode",
                mode,
                "--db",
                official_world_url,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        cli = json.loads(out.stdout)
        assert result.scores[mode].rewards == cli["rewards"]
        assert {k: v.passed for k, v in result.verdicts[mode].hard.items()} == {
            k: v["passed"] for k, v in cli["score"]["hard"].items()
        }
    assert result.reward == result.scores["official"].rewards["sum"] < 5
