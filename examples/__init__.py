"""Runnable examples of jax_reshard in a training loop."""
