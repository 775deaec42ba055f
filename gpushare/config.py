"""The one configuration model every gpushare entry point shares (``/etc/slurm/gpushare.toml``).

Why strict: the file is read by root-run Slurm hooks and long-lived daemons; a typo that silently falls
back to a default (``margn_fraction``) would change how jobs are sized without anyone noticing. So an
unknown key or a bad value is a one-line error naming the file, the key and what is expected.

Precedence for every setting: command-line flag, then ``GPUSHARE_<SECTION>_<KEY>`` environment
variable, then this file, then the default written here (docs/configuration.md lists them all).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushare.errors import GpushareError
from gpushare.gpus import BUILTIN_GPUS, DEFAULT_POWER_W, GiB, MiB, GpuModel

DEFAULT_PATH = Path("/etc/slurm/gpushare.toml")
# OOM recovery's corroboration: a measured peak at least this share of a job's GPU memory backs its OOM. The
# one definition: ``[oom] corroborate_fraction`` defaults to it, the controller's check
# (gpushare.policy.oom_recovery) reads the setting, and the agent writes a job's peak once it reaches it.
CORROBORATE_FRACTION = 0.8
FILE_NAME = "gpushare.toml"
CONFIG_VERSION = 1
NO_DIGEST = "none"  # what a component running on built-in defaults reports as its configuration's digest


class ConfigError(GpushareError, ValueError):
    """A configuration problem, phrased as one line the admin can act on."""


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtTpP]?)(i?[bB])?\s*$")
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40, "p": 1 << 50}


def parse_size(text: str | int | float, *, default_unit: str = "") -> int:
    """Parse ``12G``, ``12GiB``, ``12.5gb``, ``800M`` or a plain byte count into bytes.

    Binary units throughout (``G`` = GiB), as Slurm's ``--mem`` and nvidia-smi's MiB do.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, (int, float)):
        value, unit = float(text), default_unit
    else:
        match = _SIZE_RE.match(text)
        if not match:
            raise ValueError(f"not a size: {text!r} (use e.g. 12G, 800M, 1.5GiB)")
        value, unit = float(match.group(1)), match.group(2) or default_unit
    return int(value * _SIZE_UNITS[unit.lower()])


# --- sections --------------------------------------------------------------------------------------
# Each field's metadata may carry "check": a callable returning an error string or None, and "doc".


def _between(lo: float, hi: float) -> typing.Callable[[Any], str | None]:
    return lambda v: None if lo <= v <= hi else f"must be between {lo} and {hi}"


def _one_of(*choices: str) -> typing.Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


def _names(v: Any) -> str | None:
    return None if all(isinstance(n, str) and n and "," not in n for n in v) else "expects names (strings, no commas)"


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be positive"


def _opt(default: Any, check: typing.Callable[[Any], str | None] | None = None, doc: str = "") -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"check": check, "doc": doc})
    return field(default=default, metadata={"check": check, "doc": doc})


@dataclass
class PolicySection:
    """How a GPU request is rewritten once its memory estimate is known."""

    shared: str = _opt("shard", _one_of("shard", "none"),
                       "shard: rewrite single-GPU jobs to shard:<GiB>; none: annotate only")
    margin_fraction: float = _opt(0.10, _between(0.0, 1.0), "safety margin added to every estimate")
    margin_min_gib: float = _opt(1.0, _between(0.0, 1024.0), "smallest margin, in GiB")
    exclusive_above_fraction: float = _opt(0.90, _between(0.05, 1.0),
                                           "keep a whole GPU when estimate+margin exceeds this share")
    without_estimate: str = _opt("exclusive", _one_of("exclusive", "recover", "async"),
                                 "what a GPU job with no estimate gets; async: held while an estimation job "
                                 "runs (the default when [estimation] partition is set)")
    recover_default_gib: float = _opt(8.0, _between(0.5, 4096.0),
                                      "shared size for jobs without estimate when without_estimate=recover")
    mode: str = _opt("enforce", _one_of("enforce", "observe", "off"),
                     "enforce: decisions apply; observe: computed and recorded as what would have happened, none "
                     "applied (a pilot); off: jobs pass untouched (reloadable with SIGHUP)")
    partitions: list = _opt([], _names, "partitions where GPU jobs may be shared; empty: every partition of the "
                                        "[[nodes]] groups (only those, whose nodes have shards, are ever in scope)")
    accounts: list = _opt([], _names, "accounts whose jobs may be shared; empty: every account")
    qos: list = _opt([], _names, "QOS whose jobs may be shared; empty: every QOS")
    share_when: str = _opt("queued", _one_of("queued", "always"),
                           "queued: a job keeps its whole GPU while its partitions have idle GPUs beyond the "
                           "pending demand, and is shared only when it would wait; always: shared whatever the queue")
    queue_view_s: float = _opt(30.0, _between(1.0, 3600.0),
                               "seconds between gpushare-submitd's looks at the queue (one sinfo and one squeue "
                               "call, off the submit path); a view older than three of these is not used")
    compute_sizing: bool = _opt(False, None, "a job marked heavy ('#GPUSHARE compute=heavy') asks for more than "
                                "half a GPU's shards, so two heavy jobs never share a GPU")
    max_jobs_per_gpu: int = _opt(4, _between(0, 64),
                                 "at most this many shared jobs on one GPU: a shared job asks for at least "
                                 "1/max_jobs_per_gpu of the GPU's shards (0: memory alone decides)")


@dataclass
class SubmitSection:
    """The job_submit shim and the gpushare-submitd service behind it."""

    socket: str = _opt("/run/gpushare/submitd.sock", None, "unix socket the Lua shim connects to")
    peer_uids: list = _opt([], lambda v: None if all(not isinstance(u, bool) and str(u).isdigit() for u in v)
                           else "expects uids (non-negative integers)",
                           "uids besides root, the service's own and slurm.conf's SlurmUser that may connect")
    socket_group: str = _opt("", None, "group that may connect to the socket; empty: the primary group of "
                                       "slurm.conf's SlurmUser (slurmctld's own account)")
    timeout_ms: int = _opt(250, _between(5, 1000),
                           "shim deadline; past it the job is accepted unchanged (at most 1 s: slurmctld holds its "
                           "job write lock meanwhile)")
    breaker_timeouts: int = _opt(3, _between(1, 1000),
                                 "deadlines in a row after which the shim skips the service for breaker_open_s")
    breaker_open_s: int = _opt(30, _between(1, 3600), "how long the shim skips a service that keeps timing out")
    on_bad_directive: str = _opt("accept", _one_of("accept", "reject"),
                                 "a malformed #GPUSHARE directive: accept unchanged, or reject the job")
    max_script_bytes: int = _opt(65536, _between(1024, 16 << 20), "how much of a batch script is scanned")
    max_estimate_file_bytes: int = _opt(1 << 20, _between(1024, 64 << 20),
                                        "largest estimate JSON a directive may point to")
    cache_dir: str = _opt("/var/lib/gpushare/estimates", None, "estimate cache shared with gpu-estimate")
    log_file: str = _opt("", None, "service log; empty: standard error")
    metrics_port: int = _opt(0, _between(0, 65535), "Prometheus port of gpushare-submitd (decisions, fail-opens, "
                                                     "held jobs); 0: off")
    metrics_address: str = _opt("127.0.0.1", lambda v: None if _is_ip(v) else "must be an IP address (0.0.0.0: all)",
                                "address the submit service's metrics listen on")


@dataclass
class EstimationSection:
    """Asynchronous estimation: a held GPU job gets a gpu-estimate run as its user on a CPU partition."""

    partition: str = _opt("", None, "CPU partition for estimation jobs; empty: no asynchronous estimation")
    cpus: int = _opt(2, _between(1, 1024), "CPUs per estimation job")
    memory: str = _opt("8G", None, "Slurm --mem of an estimation job")
    time_limit_s: float = _opt(600.0, _between(30.0, 86400.0),
                               "wall-clock limit of an estimation job (gpu-estimate gets 30 s less)")
    max_per_user: int = _opt(2, _between(1, 10000), "concurrent estimation jobs per user")
    max_total: int = _opt(16, _between(1, 100000), "concurrent estimation jobs on the cluster")
    watchdog_s: float = _opt(3600.0, _between(10.0, 7 * 86400.0),
                             "a job held longer than this is released with the fallback")
    fallback: str = _opt("exclusive", _one_of("exclusive", "recover"),
                         "what a job gets when its estimation fails: all shards of a GPU, or the recover size")
    poll_s: float = _opt(2.0, _between(0.1, 600.0), "how often held jobs and estimation jobs are checked")
    spool_dir: str = _opt("/var/lib/gpushare/estimation", None,
                          "the service's own directory on the controller (its lock); results travel in the "
                          "estimation job's Comment, never through here")
    spool_max_mib_per_user: int = _opt(256, _between(1, 1 << 20),
                                       "unused since results travel through Slurm; accepted so older files load")
    command: str = _opt("", None, "estimator executable on the CPU nodes; empty: gpu-estimate next to the "
                                  "service's Python (the same install path on every host, docs/deployment.md)")


@dataclass
class EstimatorSection:
    """Defaults for gpu-estimate."""

    gpus: list = _opt(["a100-80gb"], None, "targets reported when no --gpu is given")
    iterations: int = _opt(3, _between(1, 1000), "optimizer steps captured")
    mode: str = _opt("auto", _one_of("auto", "fake", "profile"), "capture mode")
    timeout_s: float = _opt(300.0, _between(1.0, 86400.0), "wall-clock limit of one estimate")
    max_cpu_memory: str = _opt("16G", None, "address-space limit of the captured script")
    warm_worker_idle_s: float = _opt(600.0, _between(0.0, 86400.0),
                                     "a per-user worker with torch imported forks each capture and exits "
                                     "after this long unused; 0: every estimate starts a fresh interpreter")


def _regex_list(values: Any) -> str | None:
    for value in values:
        if not isinstance(value, str) or not value:
            return f"expects non-empty strings, got {value!r}"
        try:
            re.compile(value)
        except re.error as exc:
            return f"{value!r} is not a valid regular expression ({exc})"
    return None


@dataclass
class OomSection:
    """GPU out-of-memory recovery by the EpilogSlurmctld (epilog/slurmctld_epilog.py)."""

    patterns_extra: list = _opt([], _regex_list,
                                "extra regular expressions (Python syntax) that mark a log line as a GPU OOM")
    max_retries: int = _opt(1, _between(0, 10), "exclusive re-runs per job after a GPU OOM; 0 turns recovery off")
    tail_bytes: int = _opt(65536, _between(1024, 16 << 20), "how much of the end of each job log is read")
    priority_boost: int = _opt(0, _between(0, 1 << 30),
                               "extra negative nice for a recovered job on top of its own; 0: it only gets its "
                               "queue position back")
    corroborate: str = _opt("yes", _one_of("yes", "no"),
                            "yes: the larger re-run needs a gpushare 'shared' decision and measured GPU memory "
                            "near the share; no: the log message alone suffices (trusted users only)")
    corroborate_fraction: float = _opt(CORROBORATE_FRACTION, _between(0.1, 1.0),
                                       "measured peak at least this share of the job's GPU memory backs an OOM")
    max_recoveries_per_user_day: int = _opt(5, _between(0, 1000000),
                                            "OOM requeues per user in any 24 hours; 0: no limit")
    max_concurrent_hooks: int = _opt(4, _between(1, 1024),
                                     "hook runs doing Slurm queries at once; the others wait (failed jobs only)")
    retention_days: float = _opt(30.0, _between(1.0, 3650.0),
                                 "finished ledger entries and history older than this are pruned")
    read_timeout_s: float = _opt(10.0, _between(0.5, 300.0), "limit on reading one job log (slow file systems)")
    ledger_dir: str = _opt("/var/lib/gpushare/oom-ledger", None, "where recovery decisions are recorded")
    log_file: str = _opt("", None, "epilog log; empty: standard error and syslog")


_FEATURE_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,62}$")


@dataclass
class AgentSection:
    """The node agent (gpushare-agent), the slurmd Prolog/TaskProlog/Epilog and their records."""

    state_dir: str = _opt("/var/lib/gpushare/agent", None, "the agent's job store (survives restarts)")
    records_dir: str = _opt("/var/lib/gpushare/records", None, "durable per-job records (TTFK, energy, peak memory)")
    run_dir: str = _opt("/run/gpushare", None, "agent socket, MPS pipe/log directories, caps for the TaskProlog")
    device_backend: str = _opt("", None, "nvml or sim:<state.json>; empty: $GPUSHARE_DEVICE_BACKEND, else nvml")
    node_name: str = _opt("", None, "this node's Slurm name; empty: the hooks take slurmd's $SLURMD_NODENAME, "
                                    "the agent the Slurm node whose NodeHostname (else NodeName) is this host")
    sample_period_s: float = _opt(1.0, _between(0.05, 60.0), "seconds between GPU samples (CARMA: 1 Hz)")
    window_samples: int = _opt(30, _between(2, 3600), "samples in the risk window (CARMA: 30)")
    flush_every_s: float = _opt(10.0, _between(0.1, 3600.0), "how often running jobs' accumulators are persisted")
    collocation: str = _opt("mps-same-user", _one_of("mps-same-user", "mps", "fraction", "none"),
                            "caps of shared jobs: MPS among one user's jobs (else fraction), MPS always, "
                            "memory fraction only, or none")
    mps_thread_percentage: int = _opt(100, _between(1, 100), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of shared MPS jobs")
    thread_policy: str = _opt("fixed", _one_of("fixed", "gimbal-jct", "gimbal-makespan"),
                              "MPS thread share of a job starting beside others: mps_thread_percentage (fixed), or "
                              "Gimbal's coordination for mean completion time or makespan (docs/agent.md)")
    withhold: str = _opt("none", _one_of("feature", "none"),
                         "feature: shared jobs need withhold_feature, which the agent deactivates on busy nodes")
    withhold_feature: str = _opt("gpushare_open", lambda v: None if _FEATURE_RE.match(v) else
                                 "must be a letter then letters, digits or _", "node feature shared jobs need")
    withhold_node_when: str = _opt("any", _one_of("any", "all"),
                                   "withhold the node when any GPU (safe) or all GPUs (more packing) are busy")
    metrics_port: int = _opt(9402, _between(0, 65535), "Prometheus port on metrics_address; 0 turns metrics off")
    metrics_address: str = _opt("127.0.0.1", lambda v: None if _is_ip(v) else "must be an IP address (0.0.0.0: all)",
                                "address the metrics listen on: a central Prometheus needs the node's own address "
                                "or 0.0.0.0 (the metrics carry job ids and users: firewall them to the scraper)")
    admin_comment: str = _opt("yes", _one_of("yes", "no"), "write each job's record into its AdminComment")
    framework_caps: str = _opt("yes", _one_of("yes", "no"),
                               "time-sliced shared jobs also get PYTORCH_CUDA_ALLOC_CONF per_process_memory_fraction "
                               "and JAX's XLA_PYTHON_CLIENT_MEM_FRACTION, merged with the user's own settings")
    hardcap: str = _opt("off", _one_of("off", "shim", "driver", "auto"),
                        "hard per-job device memory cap for every CUDA program of a shared job (docs/isolation.md): "
                        "off; shim (the preloaded gres/hardcap library); driver (the NVIDIA driver's per-cgroup limits, "
                        "r615+, set by the Prolog); auto (driver where offered, else the shim). Shipped off: the "
                        "driver backend is unproven on an r615 driver, and the shim is preloaded into every shared job")
    hardcap_library: str = _opt("/usr/local/lib/gpushare/libgpushare-hardcap.so",
                                lambda v: None if str(v).startswith("/") else "must be an absolute path",
                                "the hard cap shim the TaskProlog preloads (make setup builds build/hardcap/"
                                "libgpushare-hardcap.so: copy it here on every GPU node)")
    backstop: str = _opt("stop", _one_of("stop", "record", "none"),
                         "a shared job over its cap + tolerance past the grace period: stop it, only record it, "
                         "or nothing")
    backstop_tolerance_mib: int = _opt(512, _between(0, 1 << 20), "MiB a job may exceed its cap before the backstop")
    backstop_grace_s: float = _opt(10.0, _between(0.0, 3600.0), "seconds over cap + tolerance before the backstop acts")
    forecast_action: str = _opt("warn", _one_of("none", "warn", "requeue"),
                                "a job forecast to cross its cap (MIGM 3.2.3): nothing, record + warn the user, "
                                "or requeue it early onto a bigger share")
    forecast_horizon_s: float = _opt(120.0, _between(1.0, 86400.0), "how far ahead a forecast crossing counts")
    forecast_window: int = _opt(120, _between(5, 100000), "samples in the forecaster's fit")
    forecast_confirm: int = _opt(5, _between(1, 10000), "consecutive positive forecasts before acting")
    lane_turn_limit_s: float = _opt(60.0, _between(0.1, 86400.0),
                                    "a lane job holding its lane's turn longer than this while others wait loses it "
                                    "(demoted: passed over at its lane's next grant)")
    lane_policy: str = _opt("fair", _one_of("fair", "srtf", "pack", "round-robin"),
                            "which waiting job of a lane gets its next turn: the least turn time so far (fair), "
                            "the least Slurm time limit left (srtf), the earliest admitted (pack), or the "
                            "longest waiting (round-robin); docs/agent.md")
    lane_sessions: int = _opt(64, _between(1, 4096), "open lane sessions (connections to the lanes socket) at most; "
                                                     "a quarter of them per user")
    log_file: str = _opt("", None, "agent/prolog/epilog log; empty: standard error")


@dataclass
class MigSection:
    """The node-side MIG executor (``gpushare mig apply|reconcile``, mig_manager/executor.py)."""

    drain: str = _opt("node", _one_of("node", "none"),
                      "node: drain the node (Reason names the run) while reshaping; none: busy checks only")
    wait: str = _opt("affected", _one_of("affected", "node"),
                     "wait for jobs on the profiles being destroyed (affected) or for every GPU job (node)")
    wait_timeout_s: float = _opt(3600.0, _between(0.0, 7 * 86400.0),
                                 "how long to wait for busy instances before rolling back")
    verify_timeout_s: float = _opt(120.0, _between(1.0, 3600.0), "how long Slurm may take to show the new GRES")
    poll_s: float = _opt(5.0, _between(0.01, 600.0), "seconds between busy checks")
    max_reconfigurations_per_hour: int = _opt(2, _between(0, 3600), "reshapes of one node per hour; 0: never")
    journal_dir: str = _opt("/var/lib/gpushare/mig", None, "per-node repartition journals")
    gres_conf: str = _opt("", None, "the site's gres.conf (read only, to check it includes gres_include); empty: "
                                    "gres.conf next to [slurm] conf's slurm.conf")
    slurm_include: str = _opt("gpushare-mig.conf", None,
                              "the only slurm.conf part the MIG executor writes (the MIG nodes' NodeName= lines), "
                              "which the site's slurm.conf Includes; relative: beside slurm.conf")
    gres_include: str = _opt("gpushare-mig-gres.conf", None,
                             "the only gres.conf part the MIG executor writes, which the site's gres.conf "
                             "Includes; relative: beside gres.conf")
    restart_commands: list = _opt(["systemctl restart slurmctld", "systemctl restart slurmd"], None,
                                  "run in order after the files change (22.05 needs both restarts)")
    reconfigure: bool = _opt(True, None, "try scontrol reconfigure before restart_commands where the release "
                                         "applies a layout that way (24.11+); false: always restart")
    device_dir: str = _opt("/dev", None, "where nvidiaN and nvidia-caps/ live, for gres.conf")
    cap_device_major: int = _opt(0, _between(0, 4095),
                                 "create missing nvidia-cap devices with this major; 0: the driver does")
    partitions: list = _opt([], None, "partitions whose pending jobs count as MIG demand; empty: all")
    demand_min_age_s: float = _opt(300.0, _between(0.0, 86400.0),
                                   "a pending job counts as MIG demand only after waiting this long")
    demand_max_per_user: int = _opt(7, _between(0, 1000),
                                    "MIG instances one user's pending jobs can ask a reshape for; 0: no cap")
    coordination: str = _opt("node", _one_of("node", "controller"),
                             "node: each MIG node reads the demand and rewrites slurm.conf/gres.conf itself (one "
                             "host or a shared /etc/slurm); controller: gpushare mig controller on the "
                             "controller decides and owns the files, nodes follow through their Slurm record")
    controller_restart_commands: list = _opt(["systemctl restart slurmctld"], None,
                                             "coordination = controller, on the controller: run when the files "
                                             "changed and scontrol reconfigure does not apply them (22.05)")
    node_restart_commands: list = _opt(["systemctl restart slurmd"], None,
                                       "coordination = controller, on the node: run once the controller has "
                                       "applied the files, when slurmd must re-register (22.05)")


@dataclass
class SlurmSection:
    """Where Slurm is, for every gpushare command that runs Slurm's tools or rewrites its files.

    One place on purpose: the hooks run under slurmctld or slurmd with different environments (the
    EpilogSlurmctld gets no ``SLURM_CONF``), and a path set in one component but not in another would make
    them talk to different clusters."""

    conf: str = _opt("", None, "slurm.conf; empty: $SLURM_CONF, else a slurm.conf beside this file, else "
                               "/etc/slurm/slurm.conf, else Slurm's built-in default")
    bin_dir: str = _opt("", None, "directory holding scontrol, squeue, sbatch; empty: $PATH, then /usr/bin")


# Older names of [slurm] settings, still read: (section, key) -> [slurm] key
LEGACY_SLURM_KEYS = {("oom", "slurm_conf"): "conf", ("agent", "slurm_conf"): "conf", ("mig", "slurm_conf"): "conf",
                     ("oom", "slurm_bin_dir"): "bin_dir"}


@dataclass
class NodeGroup:
    """GPU nodes of one shape, for ``gpushare slurm-config``."""

    names: str = _opt("", None, "Slurm hostlist, e.g. gpu[01-04]")
    gpu: str = _opt("a100-80gb", None, "catalogue model name")
    count: int = _opt(1, _between(1, 64), "GPUs per node")
    device_dir: str = _opt("/dev", None, "where the nvidiaN character devices are")
    cpus: int = _opt(0, _between(0, 100000), "CPUs= for slurm.conf (0: leave out)")
    real_memory_mb: int = _opt(0, _between(0, 1 << 30), "RealMemory= for slurm.conf (0: leave out)")
    partition: str = _opt("gpu", None, "partition the nodes go in")
    mig: bool = _opt(False, None, "GPUs partitioned by gpushare mig: slurm-config declares every MIG "
                                  "profile on a hidden FUTURE node so typed requests are accepted")


@dataclass
class ExtraGpu:
    """A site GPU model missing from the built-in catalogue."""

    total_gib: float = _opt(0.0, _positive, "device memory")
    sms: int = _opt(0, _between(0, 100000), "streaming multiprocessors")
    marketing_name: str = _opt("", None, "NVML name prefix")
    compute_capability: str = _opt("", lambda v: None if v == "" or re.fullmatch(r"\d{1,2}\.\d", v) else
                                   "must be MAJOR.MINOR, e.g. '9.0'",
                                   "CUDA compute capability; empty: from marketing_name (the CUDA context size)")
    idle_watts: float = _opt(0.0, _between(0.0, 10000.0), "idle board power; 0: the default (simulated GPUs)")
    max_watts: float = _opt(0.0, _between(0.0, 10000.0), "maximum board power; 0: the default (simulated GPUs)")


@dataclass
class Config:
    """The parsed file. ``source`` is where it came from, for messages."""

    version: int = CONFIG_VERSION
    policy: PolicySection = field(default_factory=PolicySection)
    submit: SubmitSection = field(default_factory=SubmitSection)
    estimator: EstimatorSection = field(default_factory=EstimatorSection)
    estimation: EstimationSection = field(default_factory=EstimationSection)
    oom: OomSection = field(default_factory=OomSection)
    agent: AgentSection = field(default_factory=AgentSection)
    mig: MigSection = field(default_factory=MigSection)
    slurm: SlurmSection = field(default_factory=SlurmSection)
    nodes: list[NodeGroup] = field(default_factory=list)
    gpus: dict[str, GpuModel] = field(default_factory=lambda: dict(BUILTIN_GPUS))
    source: str = "<defaults>"
    # sha256 of the file's bytes: the configuration's identity, compared between hosts (gpushare doctor,
    # the agent's gpushare_config_info metric); NO_DIGEST when no file was read
    sha256: str = NO_DIGEST
    # the paths looked at when no file was found (for the one-line warning every entry point gives)
    tried: tuple[str, ...] = ()

    @property
    def from_file(self) -> bool:
        return not self.source.startswith("<")

    def missing_line(self) -> str:
        """The one line every entry point logs when it runs on built-in defaults (empty when a file was read)."""
        if self.from_file or not self.tried:
            return ""
        return (f"no gpushare.toml (tried {', '.join(self.tried)}): running on built-in defaults; "
                "install the site's file there or set GPUSHARE_CONFIG (docs/deployment.md)")

    def slurm_conf_path(self, environ: typing.Mapping[str, str] | None = None) -> str | None:
        """The slurm.conf Slurm's tools should read (None: their built-in default).

        ``[slurm] conf``; else ``$SLURM_CONF``; else a ``slurm.conf`` beside this configuration file (both
        live in /etc/slurm on a standard install); else /etc/slurm/slurm.conf when it exists."""
        env = os.environ if environ is None else environ
        if self.slurm.conf:
            return self.slurm.conf
        if env.get("SLURM_CONF"):
            return env["SLURM_CONF"]
        candidates = [] if self.source.startswith("<") else [os.path.join(os.path.dirname(self.source), "slurm.conf")]
        for path in [*candidates, "/etc/slurm/slurm.conf"]:
            if os.path.isfile(path):
                return path
        return None

    def gpu(self, name: str) -> GpuModel:
        try:
            return self.gpus[name.lower()]
        except KeyError:
            raise ConfigError(f"{self.source}: unknown GPU {name!r}; known: {', '.join(sorted(self.gpus))}") from None


_SECTIONS: dict[str, type] = {"policy": PolicySection, "submit": SubmitSection, "estimator": EstimatorSection,
                             "estimation": EstimationSection, "oom": OomSection, "agent": AgentSection,
                             "mig": MigSection, "slurm": SlurmSection}


def _coerce(where: str, value: Any, expected: Any) -> Any:
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    base = typing.get_origin(expected) or expected
    if base is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return value
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {base.__name__}, got {value!r}")
    return value


def _build(cls: type, table: Any, where: str, env_prefix: str | None = None) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {table!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
    values: dict[str, Any] = {}
    for name, f in known.items():
        key_where = f"{where}.{name}"
        raw: Any = dataclasses.MISSING
        if env_prefix is not None:
            env_name = f"{env_prefix}_{name.upper()}"
            if env_name in os.environ:
                raw = _from_env(env_name, os.environ[env_name], hints[name])
                key_where = f"environment {env_name}"
        if raw is dataclasses.MISSING and name in table:
            raw = table[name]
        if raw is dataclasses.MISSING:
            continue
        value = _coerce(key_where, raw, hints[name])
        check = f.metadata.get("check")
        problem = check(value) if check else None
        if problem:
            raise ConfigError(f"{key_where}: {problem}, got {value!r}")
        values[name] = value
    return cls(**values)


def _from_env(name: str, text: str, expected: Any) -> Any:
    try:
        if expected is int:
            return int(text)
        if expected is float:
            return float(text)
        if (typing.get_origin(expected) or expected) is list:
            return [part.strip() for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"environment {name}: expected {expected.__name__}, got {text!r}") from None
    return text


def _is_ip(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def config_candidates(environ: typing.Mapping[str, str] | None = None) -> list[Path]:
    """Where the file is looked for when nobody named one, in order: beside ``$SLURM_CONF``, then /etc/slurm.

    Why beside ``$SLURM_CONF``: a site that keeps Slurm's files elsewhere points every Slurm program there
    with that variable, and slurmd passes it to the hooks it runs. Configless slurmd fetches only Slurm's
    own files into its cache (``/run/slurm/conf``), so on such a node the file lives in /etc/slurm
    (docs/configuration.md)."""
    env = os.environ if environ is None else environ
    found: list[Path] = []
    slurm_conf = env.get("SLURM_CONF", "")
    if slurm_conf:
        found.append(Path(slurm_conf).parent / FILE_NAME)
    found.append(DEFAULT_PATH)
    return list(dict.fromkeys(found))


def config_path(explicit: str | os.PathLike[str] | None = None) -> tuple[Path, bool]:
    """Which file to read, and whether its absence is an error (it is when someone named it).

    Unnamed: the first of ``config_candidates()`` that exists, else the standard place."""
    if explicit:
        return Path(explicit), True
    env = os.environ.get("GPUSHARE_CONFIG")
    if env:
        return Path(env), True
    candidates = config_candidates()
    for candidate in candidates:
        if candidate.exists():
            return candidate, False
    return candidates[-1], False


def load_config(path: str | os.PathLike[str] | None = None, *, require: bool = False, warn: bool = True) -> Config:
    """Read and validate the configuration.

    No file where one was named (``--config``, ``GPUSHARE_CONFIG``) is an error. No file in the standard
    places gives the built-in defaults with a warning naming the paths tried, or, with ``require`` (the
    long-running services unless told ``--defaults``), an error naming them. ``warn=False``: the caller logs
    ``cfg.missing_line()`` itself, once its own logging is set up (hooks, services)."""
    file, named = config_path(path)
    if not file.exists():
        if named:
            raise ConfigError(f"{file}: no such file (set GPUSHARE_CONFIG or pass --config)")
        tried = tuple(str(p) for p in config_candidates())
        if require:
            raise ConfigError(f"no gpushare.toml (tried {', '.join(tried)}); install the site's file, set "
                              "GPUSHARE_CONFIG or pass --config, or start with --defaults to run on built-in defaults")
        cfg = parse_config({}, source="<defaults>")
        cfg.tried = tried
        if warn:
            logging.getLogger("gpushare.config").warning("%s", cfg.missing_line())
        return cfg
    try:
        raw = file.read_bytes()
        data = tomllib.loads(raw.decode("utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file}: not valid TOML: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: cannot read: {exc}") from exc
    cfg = parse_config(data, source=str(file))
    cfg.sha256 = file_digest(raw)
    return cfg


def installed_version() -> str:
    """This host's slurm-gpushare release (hosts compare it beside the configuration's digest)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("slurm-gpushare")
    except PackageNotFoundError:
        return "unknown"


def file_digest(data: bytes) -> str:
    """The configuration's identity: sha256 of the file's bytes (a comment changes it too: hosts should hold
    the same file, not merely equivalent ones, so that a diff between two hosts is always empty)."""
    return hashlib.sha256(data).hexdigest()


def parse_config(data: dict[str, Any], source: str = "<string>") -> Config:
    """Validate an already-parsed TOML document (tests and ``gpushare config check`` use this)."""
    allowed = {"version", "nodes", "gpus", *_SECTIONS}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{source}: unknown section or key {unknown[0]!r} (known: {', '.join(sorted(allowed))})")
    version = data.get("version", CONFIG_VERSION)
    if version != CONFIG_VERSION:
        raise ConfigError(f"{source}: version: this gpushare reads version {CONFIG_VERSION}, got {version!r}")
    cfg = Config(source=source)
    data = _fold_legacy_slurm_keys(data, source)
    for name, cls in _SECTIONS.items():
        setattr(cfg, name, _build(cls, data.get(name, {}), f"{source}: [{name}]", f"GPUSHARE_{name.upper()}"))
    for gpu_name, table in (data.get("gpus") or {}).items():
        extra = _build(ExtraGpu, table, f"{source}: [gpus.{gpu_name}]")
        if extra.total_gib <= 0:
            raise ConfigError(f"{source}: [gpus.{gpu_name}].total_gib: required and must be positive")
        major, _, minor = extra.compute_capability.partition(".")
        cfg.gpus[gpu_name.lower()] = GpuModel(
            name=gpu_name.lower(), marketing_name=extra.marketing_name or gpu_name,
            total_bytes=int(extra.total_gib * GiB), sms=extra.sms,
            sm_arch=(int(major), int(minor)) if extra.compute_capability else (0, 0),
            power_w=(extra.idle_watts or DEFAULT_POWER_W[0], extra.max_watts or DEFAULT_POWER_W[1]),
        )
    nodes = data.get("nodes", [])
    if not isinstance(nodes, list):
        raise ConfigError(f"{source}: nodes: expected [[nodes]] tables")
    for index, table in enumerate(nodes):
        group = _build(NodeGroup, table, f"{source}: [[nodes]] #{index + 1}")
        if not group.names:
            raise ConfigError(f"{source}: [[nodes]] #{index + 1}.names: required (a Slurm hostlist)")
        cfg.gpu(group.gpu)  # unknown model → ConfigError naming it
        cfg.nodes.append(group)
    _check_estimation(cfg, data, source)
    for gpu_name in cfg.estimator.gpus:
        try:
            from gpushare.gpus import parse_target

            parse_target(str(gpu_name), cfg.gpus)
        except ValueError as exc:
            raise ConfigError(f"{source}: [estimator].gpus: {exc}") from None
    return cfg


def _fold_legacy_slurm_keys(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Move the older per-section Slurm paths into ``[slurm]``; the same setting twice must agree."""
    out = {name: dict(table) if isinstance(table, dict) else table for name, table in data.items()}
    slurm = out.setdefault("slurm", {})
    if not isinstance(slurm, dict):
        return out  # _build reports it
    for (section, key), target in LEGACY_SLURM_KEYS.items():
        table = out.get(section)
        if not isinstance(table, dict) or key not in table:
            continue
        value = table.pop(key)
        if value in ("", None):
            continue
        if slurm.get(target, "") not in ("", value):
            raise ConfigError(f"{source}: [{section}] {key} = {value!r} disagrees with [slurm] {target} = "
                              f"{slurm[target]!r}; set it once, in [slurm]")
        slurm[target] = value
    return out


def _check_estimation(cfg: Config, data: dict[str, Any], source: str) -> None:
    """Cross-field rules of asynchronous estimation, and its default where a CPU partition exists."""
    raw_policy = data.get("policy")
    policy = raw_policy if isinstance(raw_policy, dict) else {}
    chosen = "without_estimate" in policy or "GPUSHARE_POLICY_WITHOUT_ESTIMATE" in os.environ
    if cfg.estimation.partition and not chosen:
        cfg.policy.without_estimate = "async"
    if cfg.policy.without_estimate == "async" and not cfg.estimation.partition:
        raise ConfigError(f"{source}: [policy].without_estimate: 'async' needs [estimation] partition "
                          "(a CPU partition for estimation jobs)")
    if cfg.estimation.watchdog_s <= cfg.estimation.time_limit_s:
        raise ConfigError(f"{source}: [estimation].watchdog_s: must exceed time_limit_s "
                          f"({cfg.estimation.time_limit_s:g}), got {cfg.estimation.watchdog_s:g}")
    try:
        parse_size(cfg.estimation.memory)
    except ValueError as exc:
        raise ConfigError(f"{source}: [estimation].memory: {exc}") from None


def settings_table() -> list[tuple[str, str, str, str]]:
    """(config key, environment variable, default, doc) for every setting, for docs and --help."""
    rows = []
    for section, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            # callable(): MISSING is no factory; every setting has a default or a factory
            default = f.default if not callable(f.default_factory) else f.default_factory()
            rows.append((f"[{section}] {f.name}", f"GPUSHARE_{section.upper()}_{f.name.upper()}",
                         repr(default), f.metadata.get("doc", "")))
    return rows
