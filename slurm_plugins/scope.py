"""Where gpushare acts, and whether it acts: ``[policy] mode`` and the partition/account/QOS scope.

Why beside the decision and not inside it: ``decide`` answers "what would be right for this job"; these
rules answer "may we change it here". Keeping them apart lets observe mode record exactly what enforce
would have done (docs/submit-path.md, "Off switch, pilot mode and scope").

Pure: request, decision and config in, a Decision out.
"""

from __future__ import annotations

from typing import Any

from gpushare.config import Config
from gpushare.slurm_plugins.decision import RECORD_VERSION, Decision, SubmitRequest


def job_partitions(request: SubmitRequest) -> list[str]:
    """The partitions the job may run in: its --partition list, else the default one the shim found."""
    given = request.partition or request.default_partition or ""
    return [name.strip() for name in given.split(",") if name.strip()]


def out_of_scope(request: SubmitRequest, cfg: Config) -> str | None:
    """Why this job must be left as it is, or None when sharing may apply to it.

    Only partitions of the ``[[nodes]]`` groups have shards (gres.conf comes from the same groups), so only
    they are ever in scope: a shard request elsewhere could never run. Known from gpushare.toml, so no
    Slurm call per submission. A job whose partition the shim could not tell keeps the old behaviour
    (in scope) unless ``[policy] partitions`` names a list, which it then cannot be shown to be in."""
    partitions = job_partitions(request)
    with_shards = {group.partition for group in cfg.nodes}
    allowed = set(cfg.policy.partitions) or with_shards
    if cfg.nodes:
        allowed &= with_shards
    if partitions:
        outside = [name for name in partitions if name not in allowed]
        if outside:
            where = "has no GPU shards ([[nodes]] groups)" if cfg.nodes and outside[0] not in with_shards \
                else "is not in [policy] partitions"
            return f"partition {outside[0][:64]} {where}; request left as is"
    elif cfg.policy.partitions:
        return "the job's partition is unknown (the default one); [policy] partitions is set; request left as is"
    if cfg.policy.accounts and request.account not in cfg.policy.accounts:
        return f"account {(request.account or '(default)')[:64]} is not in [policy] accounts; request left as is"
    if cfg.policy.qos and request.qos not in cfg.policy.qos:
        return f"QOS {(request.qos or '(default)')[:64]} is not in [policy] qos; request left as is"
    return None


def outside(request: SubmitRequest, why: str) -> Decision:
    """The record of a GPU job left alone because it is out of scope: unchanged, and it says why."""
    return Decision(action="accept", record={"v": RECORD_VERSION, "decision": "out-of-scope",
                                             "old": request.tres_per_node, "why": why})


def observed(decision: Decision) -> Decision:
    """Observe mode: the job goes on unchanged; its record says what enforce would have done.

    ``decision`` becomes ``observe`` (so no node part treats the job as shared: caps, backstop and OOM
    recovery key on ``shared``) and ``would`` keeps the decision enforce would have applied, ``new`` the
    request it would have asked for. No message to the researcher: a pilot changes nothing they see."""
    if decision.action == "accept" and not decision.record:
        return decision  # not a GPU job
    record: dict[str, Any] = dict(decision.record) if decision.record else {"v": RECORD_VERSION}
    record["would"] = "reject" if decision.action == "reject" else record.get("decision", "accept")
    record["decision"] = "observe"
    if decision.action == "reject":
        record["why"] = decision.reject_message[:200]
    if decision.hold:
        record["would_hold"] = True
    return Decision(action="accept", record=record)
