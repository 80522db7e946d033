"""The rollout service (see DESIGN.md)."""
