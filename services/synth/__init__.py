"""The synth service (see DESIGN.md)."""
