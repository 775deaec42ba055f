"""The Slurm adapter: the one place that knows how each Slurm version prints and takes job facts."""
