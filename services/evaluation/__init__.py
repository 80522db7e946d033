"""Evaluation of TravelPlanner runs: the run folder, Table-1 metrics with official denominators,
per-constraint pass rates, failure categories, cohorts, trajectory signals, backtracking
diagnostics, paired bootstrap comparison of runs, plots and a markdown report.

Spec: ../shared/spec/paper-recipe.md (Evaluation), agent-star.md §6.1, travelplanner.md §6–§7.
Scores come from the reward evaluator (`services.reward.evaluator`); nothing here re-implements
a check. In-domain results only: the OOD QA suite lives in `services.qa` and reports apart.
"""
