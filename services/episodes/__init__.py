"""The episode API: one TravelPlanner episode (query, tool budget, answer, reward) behind HTTP, for trainers
that are not ours (docs/environments.md)."""
