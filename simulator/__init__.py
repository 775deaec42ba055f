"""Trace-driven what-if simulator: the agent's placement policies on simulated GPUs (docs/simulator.md)."""
