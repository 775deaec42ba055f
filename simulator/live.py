"""``--policy live``: the stack an admin would deploy, read from their gpushare.toml and Slurm release.

Why: every other policy of the simulator is one idea in isolation (CARMA's MAGM, Slurm's first-fit,
Gimbal's caps); what a site runs is a combination of settings, and the admin's table needs one row that
is that combination. Each setting maps to the model of the part that implements it:

=====================================  ==========================================================================
placement                              Slurm's own shard selection: first-fit (every release without
                                       ``LL_SHARED_GRES``), or least-loaded (24.11+ with it); by default
                                       what ``gpushare slurm-config`` advises for the release and
                                       ``share_when`` (``advised_placement``), else as the site says
``[agent] withhold = "feature"``       the agent closes a node to shared jobs while any (``withhold_node_when``
                                       ``any``) or every (``all``) GPU not held whole is risky or warming
                                       (``gpushare.policy.withhold.node_open``, the agent's own function)
``[agent] thread_policy``              ``fixed``: no caps on SMs; ``gimbal-*``: a starting job's MPS share by
                                       ``gpushare.policy.gimbal.starting_share`` (the simulator's live Gimbal)
``framework_caps`` / ``backstop``      a job that outgrows its share hits its own cap (``caps`` on) or takes free
                                       memory (off); the growth model of docs/simulator.md
``[oom] max_retries``                  OOM recovery on (≥ 1) or off
``[policy] margin_*``                  the margin added to each estimate
``[policy] exclusive_above_fraction``  estimate + margin above it keeps a whole GPU
``[policy] max_jobs_per_gpu``          a shared job's shards are at least that fraction of the GPU
                                       (``gpushare.policy.share_gate.share_shards``)
estimates                              gpu-estimate's measured error (``estimators.MEASURED``)
=====================================  ==========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from gpushare.config import Config, ConfigError
from gpushare.slurm.version import SlurmVersion

PLACEMENTS = ("advised", "first-fit", "least-loaded")


@dataclass(frozen=True)
class LiveSetup:
    """The settings of the deployed stack that change what the simulation does."""

    release: str = "22.05"
    least_loaded: bool = False  # Slurm 24.11+ with SelectTypeParameters=LL_SHARED_GRES
    withhold: str = "none"  # or "feature"
    withhold_when: str = "any"
    thread_policy: str = "fixed"  # or gimbal-jct / gimbal-makespan
    caps: bool = True
    recovery: bool = True
    margin_fraction: float = 0.10
    margin_min_gib: float = 1.0
    exclusive_above: float = 0.90
    share_when: str = "always"  # or "queued": share only while idle whole GPUs do not cover the queue
    queue_view_s: float = 30.0  # how often gpushare-submitd refreshes its view of the queue
    compute_sizing: bool = False  # a heavy job asks for more than half a GPU's shards
    max_jobs_per_gpu: int = 4  # a shared job asks for at least this fraction of a GPU's shards (0: memory alone)

    def describe(self) -> str:
        """One line for the report: what was deployed."""
        placement = "least-loaded shards" if self.least_loaded else "first-fit shards"
        withheld = f"withhold {self.withhold_when}" if self.withhold == "feature" else "no withholding"
        return (f"live stack: Slurm {self.release} {placement}, {withheld}, threads {self.thread_policy}, "
                f"caps {'on' if self.caps else 'off'}, recovery {'on' if self.recovery else 'off'}, "
                f"margin {self.margin_fraction:.0%}/{self.margin_min_gib:g} GiB, whole GPU above "
                f"{self.exclusive_above:.0%}, shared {self.share_when}"
                + (", heavy jobs over half a GPU" if self.compute_sizing else "")
                + (f", at most {self.max_jobs_per_gpu} jobs per GPU" if self.max_jobs_per_gpu else ""))


def advised_placement(cfg: Config, version: SlurmVersion) -> str:
    """The shard placement ``gpushare slurm-config`` advises: ``least-loaded`` where the release offers
    ``LL_SHARED_GRES`` and jobs are shared whatever the queue; ``first-fit`` otherwise.

    Why first-fit with ``share_when = "queued"``: a job is then shared only when no GPU is idle, and
    first-fit keeps the GPUs that do come free whole for jobs of several GPUs, where least-loaded spreads
    shards over every GPU (slurm_plugins/slurm_config.py's comment, measured in docs/benchmarks.md).
    Without ``LL_SHARED_GRES`` Slurm walks a node's GPUs in index order and takes the first with enough
    shards free, on every release."""
    return "least-loaded" if version.least_loaded_shared_gres and cfg.policy.share_when != "queued" else "first-fit"


def setup(cfg: Config, release: str = "22.05", placement: str = "advised") -> LiveSetup:
    """What ``cfg`` and Slurm ``release`` deploy; ``placement`` is the site's ``SelectTypeParameters``:
    ``advised`` (what ``gpushare slurm-config`` advises), ``first-fit`` or ``least-loaded``
    (``LL_SHARED_GRES``, 24.11+ only)."""
    version = SlurmVersion.parse(release)
    if placement not in PLACEMENTS:
        raise ConfigError(f"shard placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if placement == "least-loaded" and not version.least_loaded_shared_gres:
        raise ConfigError(f"least-loaded shard placement (LL_SHARED_GRES) needs Slurm 24.11 or later, "
                          f"not {release}")
    if placement == "advised":
        placement = advised_placement(cfg, version)
    agent = cfg.agent
    return LiveSetup(
        release=release, least_loaded=placement == "least-loaded", withhold=agent.withhold,
        withhold_when=agent.withhold_node_when, thread_policy=agent.thread_policy,
        caps=agent.framework_caps == "yes" or agent.backstop == "stop", recovery=cfg.oom.max_retries > 0,
        margin_fraction=cfg.policy.margin_fraction, margin_min_gib=cfg.policy.margin_min_gib,
        exclusive_above=cfg.policy.exclusive_above_fraction, share_when=cfg.policy.share_when,
        queue_view_s=cfg.policy.queue_view_s, compute_sizing=cfg.policy.compute_sizing,
        max_jobs_per_gpu=cfg.policy.max_jobs_per_gpu)
