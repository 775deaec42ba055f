"""A real local Slurm cluster with simulated GPUs, for the demo and the integration tests (not installed)."""
