"""Reward: the TravelPlanner evaluator (official-compatible and strict) and reward shaping.

from services.reward import Evaluator, reward
score = Evaluator(world, mode="strict").score(query, plan)
r = reward(score, "curriculum", epoch=3)
"""

from services.reward.evaluator import (
    COMMONSENSE_CHECKS,
    HARD_CHECKS,
    Evaluation,
    Evaluator,
    PlanError,
    SplitMetrics,
    evaluate_split,
)
from services.reward.rewards import DEFAULT_CURRICULUM, Curriculum, all_rewards, reward

__all__ = [
    "COMMONSENSE_CHECKS",
    "DEFAULT_CURRICULUM",
    "HARD_CHECKS",
    "Curriculum",
    "Evaluation",
    "Evaluator",
    "PlanError",
    "SplitMetrics",
    "all_rewards",
    "evaluate_split",
    "reward",
]
