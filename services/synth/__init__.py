"""Synthesis: feasible queries, the oracle planner and teacher trajectories (docs/architecture.md)."""
