"""Training: train state, jitted steps, loops, checkpoints and metrics."""
