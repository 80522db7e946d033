"""The learner service (see DESIGN.md)."""
