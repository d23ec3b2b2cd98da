"""Test set-up: 8 simulated CPU devices, before any JAX backend starts."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
