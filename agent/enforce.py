"""What the agent does to a job when the backstop or the forecaster acts: the I/O side, kept small.

- ``stop_processes``: SIGKILL the job's processes on the GPU. Each pid is checked again, just before the
  signal, to still belong to the job (``Sampler.owner_now``: its claim and its uid; a pid reused by another
  job or user is never signalled).
  Killing the GPU processes frees the memory at once; the batch script then fails as on any OOM.
- ``append_to_job_log``: a line in the job's own log, written by a child process running **as the
  job's user** (``setuid``/``setgid``, no supplementary groups), opening the existing file with
  ``O_APPEND | O_NOFOLLOW`` and never creating one: root never writes through a user-controlled path.
- ``requeue_early``: ``scontrol requeuehold`` → ``update`` (a larger shard count, when the job asked for
  shards) → ``release``, through :class:`gpushare.slurm.client.SlurmClient` and its typed ``Job`` records.
  Fail-safe: whatever fails after the hold, the release is still tried, so a job is never left held.

Every function logs and returns False on failure instead of raising: our failures never fail a job.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from gpushare.slurm.client import SlurmClient
    from gpushare.slurm.gres_request import GresRequest

log = logging.getLogger("gpushare.agent")


def stop_processes(job: str, pids: list[int], owner: Callable[[int], str | None]) -> list[int]:
    """SIGKILL the ``pids`` that ``owner`` still places in ``job`` (for an unattributed process: "" and a
    check that it still belongs to no job); returns the pids signalled."""
    done = []
    for pid in sorted(set(pids)):
        if pid <= 1 or owner(pid) != job:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            done.append(pid)
        except ProcessLookupError:
            continue
        except OSError as exc:
            log.error("job %s: cannot stop pid %d: %s", job, pid, exc)
    return done


def append_to_job_log(path: str, uid: int, gid: int, text: str, timeout_s: float = 10.0) -> bool:
    """Append ``text`` to ``path`` as ``uid``/``gid`` (never root, never creating, never through a symlink)."""
    if uid < 0 or gid < 0 or not os.path.isabs(path) or "\0" in path:
        log.warning("job log %r: not written (uid %s, gid %s)", path[:200], uid, gid)
        return False
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _WRITER, path], input=text.encode("utf-8", "replace"),
                              user=uid, group=gid, extra_groups=[], capture_output=True, timeout=timeout_s,
                              cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    except (OSError, subprocess.SubprocessError) as exc:
        log.error("job log %s: %s", path[:200], exc)
        return False
    if done.returncode != 0:
        log.warning("job log %s: not written: %s", path[:200], done.stderr.decode("utf-8", "replace")[-300:])
    return done.returncode == 0


# Runs as the job's user: open the existing log without following a final symlink, append, close.
_WRITER = ("import os, sys\n"
           "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK)\n"
           "import stat\n"
           "if not stat.S_ISREG(os.fstat(fd).st_mode): sys.exit('not a regular file')\n"
           "os.write(fd, sys.stdin.buffer.read(4096))\n")


def write_job_message(client: SlurmClient, job_id: str, uid: int, text: str, node: str = "") -> bool:
    """Write ``text`` into the job's stdout (and stderr, when separate) log; False when impossible."""
    from gpushare.slurm.jobs import log_paths

    try:
        job = client.require_job(job_id)
    except Exception as exc:  # noqa: BLE001 - Slurm down: the record still says it
        log.error("job %s: no Slurm record for its log (%s); message only in the agent log: %s", job_id, exc,
                  text.strip())
        return False
    gid = job.group_id if job.group_id is not None else -1
    owner = job.user_id if job.user_id is not None else uid
    wrote = False
    for path in dict.fromkeys(log_paths(job, node)):
        wrote = append_to_job_log(path, owner, gid, text) or wrote
    return wrote


def bigger_share(request: GresRequest, predicted_bytes: float, margin_gib: float = 1.0) -> int | None:
    """Shard count (GiB) for the rerun: the forecast peak + margin, when the job asked for shards."""
    shards = request.named("shard")
    if not shards:
        return None
    return max(shards[0].count + 1, math.ceil(predicted_bytes / (1 << 30) + margin_gib))


def requeue_early(client: SlurmClient, job_id: str, predicted_bytes: float) -> bool:
    """Requeue a running job before it runs out of memory, onto a larger share; never leaves it held."""
    try:
        job = client.require_job(job_id)
        if job.requeue is False or not job.states or job.states[0] != "RUNNING":
            log.warning("job %s: not requeued early (state %s, requeue %s)", job_id, job.states, job.requeue)
            return False
        shards = bigger_share(job.gres_per_node, predicted_bytes)
        client.requeue_hold(job_id)
    except Exception as exc:  # noqa: BLE001
        log.error("job %s: early requeue failed before the hold: %s", job_id, exc)
        return False
    ok = True
    try:
        if shards is not None:
            client.update_job(job_id, gres=f"shard:{shards}")
    except Exception as exc:  # noqa: BLE001 - it reruns with its old share rather than not at all
        log.error("job %s: requeued, but its share was not enlarged: %s", job_id, exc)
    finally:
        try:
            client.release(job_id)
        except Exception as exc:  # noqa: BLE001
            ok = False
            log.error("job %s: requeued and HELD: release failed (%s); scontrol release %s", job_id, exc, job_id)
    return ok
