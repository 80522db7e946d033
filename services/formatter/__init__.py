"""The formatter service (see DESIGN.md)."""
