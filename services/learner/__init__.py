"""The learner service: SFT and GRPO/DAPO on DeepSpeed, weight publication (docs/architecture.md)."""
