"""``gpushare-prolog``: Slurm's node Prolog (root, on the job's node, before the job starts).

It registers a GPU job with the node agent (GPUs, estimate, caps, start energy counters) and leaves the
job's caps where the TaskProlog, which runs as the user, can read them. When the agent is down it writes
the same registration itself (``gpushare.node.jobs``: same entry, memory-fraction caps only since no
MPS daemon can be vouched for), so a job started during an agent restart still gets its energy record.

A failing Prolog drains the node (docs/compatibility.md), so this entry point catches everything and exits 0:
our own problems are logged, never turned into a drained node.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from gpushare.atomic import write_json_atomic
from gpushare.node.caps import CAPS_VERSION, caps_path
from gpushare.run_dir import make_run_dir

if TYPE_CHECKING:
    from gpushare.slurm.client import SlurmClient
    from gpushare.gres.device import GpuBackend
    from gpushare.config import AgentSection

log = logging.getLogger("gpushare.prolog")


def write_caps(run_dir: str, job: str, env: dict[str, str]) -> None:
    make_run_dir(run_dir)  # the TaskProlog reads the caps as the job's user
    make_run_dir(Path(run_dir) / "jobs")
    write_json_atomic(caps_path(run_dir, job), {"v": CAPS_VERSION, "job": job, "env": env}, mode=0o644)


def register(env: Mapping[str, str], cfg: AgentSection, client: SlurmClient | None = None,
             backend: GpuBackend | None = None, config: tuple[str, str] | None = None) -> dict[str, Any] | None:
    """Register the job of this Prolog; returns the exports written for it (None: not a GPU job).

    ``config``: this node's configuration (path, sha256), compared with the controller's in the job's record."""
    from gpushare.node.api import call, socket_path
    from gpushare.node.hook_env import job_from_env, slurm_facts

    job = job_from_env(env)
    if job is None:
        return None
    if not socket_path(cfg).exists() and not Path(cfg.state_dir).is_dir():
        log.debug("job %s: no agent deployed on this node (no socket, no state directory); nothing to do", job.job)
        return None  # costs a job start no Slurm call on nodes without the agent
    slurm_job = None
    try:
        if client is None:
            from gpushare.slurm.client import SlurmClient

            client = SlurmClient(env.get("SLURM_CONF") or None)
        slurm_job = client.job(job.job)
    except Exception as exc:  # noqa: BLE001 - without Slurm's record the job is registered uncapped
        log.warning("job %s: Slurm record unavailable (%s); registered without estimate", job.job, exc)
    if config is not None and slurm_job is not None:
        compare_config(job.job, slurm_job.admin_comment, *config)
    facts = slurm_facts(job, slurm_job)
    try:
        reply = call(socket_path(cfg), {"op": "register", "job": facts}, timeout_s=5.0)
        if not reply.get("ok"):
            raise ValueError(reply.get("error", "refused"))
        exports = dict(reply.get("env") or {})
    except Exception as exc:  # noqa: BLE001 - agent down or refusing: register locally
        log.warning("job %s: agent unavailable (%s); registering from the Prolog", job.job, exc)
        exports = _register_locally(facts, cfg, backend)
    if cfg.hardcap != "off":
        from gpushare.node.hardcap import apply

        if apply(job.job, job.uid, job.gpus, exports, cfg.hardcap, backend=backend,
                 device_backend=cfg.device_backend or None) == "shim":
            exports["GPUSHARE_HARDCAP"] = "1"  # read (not exported) by the TaskProlog: preload the shim
            # the framework fraction stays of the whole GPU: PyTorch multiplies it by the device's total memory
            # property, which the shim leaves alone (measured on an H200, docs/isolation.md)
    write_caps(cfg.run_dir, job.job, exports)
    log.info("job %s registered on GPUs %s: %s", job.job, job.gpus, exports.get("GPUSHARE_CAPS_MODE"))
    return exports


def compare_config(job: str, admin_comment: str, path: str, sha256: str) -> bool:
    """Does this node read the controller's gpushare.toml? The submit decision records the controller's
    digest (``cfg`` in the AdminComment record); a different one here is logged at ERROR on every job start,
    through Slurm, with no other host asked. The job proceeds (on this node's settings). False: it differs."""
    from gpushare.slurm.record import parse

    theirs = (parse(admin_comment) or {}).get("cfg")
    if not isinstance(theirs, str) or not theirs or sha256[:len(theirs)] == theirs:
        return True
    log.error("job %s: this node's gpushare.toml (%s, sha256 %s) is not the controller's (sha256 %s, in the job's "
              "record): the job is capped by this node's settings; `gpushare doctor` lists every node that differs",
              job, path, sha256[:12], theirs[:12])
    return False


def _register_locally(facts: dict[str, Any], cfg: AgentSection, backend: GpuBackend | None) -> dict[str, str]:
    from gpushare.gres import open_backend
    from gpushare.node.jobs import build_entry, clean_facts, tenants_of
    from gpushare.node.store import JobStore

    clean = clean_facts(facts)
    backend = backend or open_backend(cfg.device_backend or None)
    store = JobStore(Path(cfg.state_dir) / "jobs")
    with store.locked(clean["job"]):
        tenants = tenants_of(store.all(), clean["gpus"], clean["job"])
        entry = build_entry(clean, cfg, backend, tenants, time.time(), by="prolog", mps_ok=False)
        try:
            store.put(entry)
        except OSError as exc:  # a full disk: the caps still reach the job; the agent adopts it when back
            log.error("job %s: not written to the job store %s (%s); the job runs with its caps, unrecorded "
                      "until the agent adopts it", clean["job"], store.dir, exc.strerror or exc)
    return dict(entry["env"])


def main(argv: list[str] | None = None) -> int:
    from gpushare.hooks import run_hook
    from gpushare.slurm.client import SlurmClient

    return run_hook("gpushare-prolog", lambda cfg: register(os.environ, cfg.agent, client=SlurmClient.from_config(cfg),
                                                            config=(cfg.source, cfg.sha256)),
                    lambda cfg: cfg.agent.log_file, "job proceeds")


if __name__ == "__main__":
    sys.exit(main())
