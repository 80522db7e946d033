"""The STAR pipeline: the recipe, placement, the synth, SFT and eval stages and the run report (the controller,
services/controller, runs them)."""
