"""The STAR pipeline: recipes, the training controller and the embedded run mode."""
