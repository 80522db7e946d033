"""The formatter service: plan text to the benchmark's JSON plan (docs/architecture.md)."""
