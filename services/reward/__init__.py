"""The reward service (see DESIGN.md)."""
