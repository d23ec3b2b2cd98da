"""Benchmarks for jax_reshard: refit timing against baselines, and planning at scale.

Run ``python -m benchmarks.refit --quick`` (``make bench``), ``python -m benchmarks.refit
--full`` (``make bench-full``) and ``python -m benchmarks.plan_scale`` (no devices needed).
"""
