"""OOM recovery under ``[policy] mode = "observe"``: what enforce would have requeued, recorded, none of it done.

Why a pilot records rather than acts: an admin watching before trusting needs to see each OOM requeue the
stack would have made (the job, its new GRES, why) in the places they already read — the job's
``gpushare:`` record (:func:`record`: AdminComment, or the database row once Slurm has the job ended), the
EpilogSlurmctld's log, the OOM ledger and its history, and a counter — while the job stays as Slurm ended it: no hold, no requeue, no
GRES change, no per-user recovery charged, no learned floor raised, no note in the user's log.

The counter is ``gpushare_oom_recoveries_total{outcome="would_requeue"}`` (gpushare/oom_counts.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gpushare.epilog.ledger import Ledger
from gpushare.policy.oom_recovery import Action, JobFacts, OomVerdict
from gpushare.epilog.stored_record import WAIT_S, _fields_to_set, _live_record, rows
from gpushare.slurm import record as record_format
from gpushare.slurm.admin_comment import merge_fields, merge_write
from gpushare.oom_counts import count
from gpushare.slurm.client import SlurmClient, SlurmError

log = logging.getLogger("gpushare.epilog.slurmctld")
OBSERVED = "observed"  # the ledger state of a run whose requeue was only recorded


def would_requeue(job: JobFacts, verdict: OomVerdict, action: Action, ledger: Ledger,
                  client: SlurmClient) -> str:
    """Record the requeue ``action`` would have made; returns the hook's outcome line."""
    new_gres = action.new_gres or job.gres.text
    text = f"would have requeued with {new_gres} ({action.reason})"
    # in the job's record as the made recovery's ``oom`` entry is: our own short fields, no free text
    would = {"do": "requeue", "from": job.gres.text, "to": new_gres, "fam": verdict.family, "n": action.retry,
             "max": action.max_retries}
    log.warning("job %s: [policy] mode = observe: %s; nothing requeued; matched: %s", job.job_id, text,
                verdict.message)
    log.info("job %s: the would-be requeue recorded: %s", job.job_id, record(client, job.job_id, would))
    ledger.put({"job": job.job_id, "restarts": job.restarts, "action": "would_requeue", "state": OBSERVED,
                "reason": action.reason, "family": verdict.family, "message": verdict.message,
                "source": verdict.source, "old_gres": job.gres.text, "new_gres": new_gres, "retry": action.retry,
                "max_retries": action.max_retries, "steps": []})
    ledger.append_history({"job": job.job_id, "restarts": job.restarts, "event": "would_requeue",
                           "reason": action.reason, "new_gres": new_gres, "message": verdict.message})
    count(ledger.dir, "would_requeue")
    return f"observe: {text}"


def record(client: SlurmClient, job_id: str, would: dict[str, Any], tries: int = 8) -> str:
    """``oom_would`` into the job's ``gpushare:`` record: slurmctld's AdminComment while the job is live, else
    (Slurm refuses ``scontrol update`` once it has ended: 22.05, measured) the database row's SystemComment and
    AdminComment as the node Epilog stores its summary (gpushare.epilog.stored_record: the controller's keys
    kept, a foreign comment never overwritten, read back). Never raises; returns where it went."""
    try:
        if merge_write(client, job_id, merge_fields(oom_would=would)):
            return "AdminComment"
    except (SlurmError, OSError, ValueError) as exc:
        log.info("job %s: AdminComment not updated (%s); trying the accounting database", job_id,
                 str(getattr(exc, "reason", exc))[:200])
    try:
        for attempt in range(tries):
            found = rows(client, job_id)
            if found is None:
                return "nowhere in the job: no accounting database (the log, ledger and counter have it)"
            if found and found[-1].ended:
                break
            time.sleep(WAIT_S * (attempt + 1))
        else:
            return "nowhere in the job: the database did not show it ended"
        row = found[-1]
        for _ in range(3):
            base = record_format.stored(row.admin_comment, row.system_comment)
            if base is None:
                base = _live_record(client, job_id)[0]
            sets = _fields_to_set(row, {**base, "oom_would": would})
            if not sets:
                return "nowhere in the job: its stored comments are not ours"
            client.run("sacctmgr", "-i", "modify", "job", "where", f"jobid={job_id}", "set", *sets)
            row = (rows(client, job_id) or [row])[-1]
            stored = record_format.stored(row.admin_comment, row.system_comment) or {}
            if stored.get("oom_would") == would:
                return "the database's " + " and ".join(s.split("=", 1)[0] for s in sets)
        return "nowhere in the job: the stored comment kept changing"
    except (SlurmError, OSError, ValueError) as exc:
        return f"nowhere in the job: {str(exc)[-120:]}"
