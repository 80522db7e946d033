"""The rollout service: ReAct agents on an engine, token-in/token-out trajectories (docs/architecture.md)."""
