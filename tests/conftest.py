"""Shared pytest setup. The real-Slurm fixtures live in tests/slurm_harness.py."""
