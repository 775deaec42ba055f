"""The per-job records ledger: what each GPU job did on its node (TTFK, energy, peak memory, exit).

Why this shape: the slurmd Epilog of every job on a node writes here, up to hundreds at once when a job
array ends. Each run of a job on a node (``<node>.<job id>.<restart count>.json``; a multi-node job has
one per node, and a directory several nodes write to keeps them apart) gets its own file, written whole with
``gpushare.atomic`` (temp file + fsync + rename), so concurrent epilogs never touch the same file and a
crash leaves the old file or the new one. An append-only ``history.jsonl`` (one line per record, one
``write`` under an exclusive ``flock``: the OOM ledger's mechanism, reused from ``gpushare.epilog.ledger``) gives
``gpushare report --since`` a cheap time index. Records are readable by everyone (0644): they hold what
``squeue``/``sacct`` already show plus energy and memory figures.

Record format (``v`` 1; J, bytes, seconds; produced by ``gpushare.node.jobs.final_record``)::

    v, job, restarts, node, uid, user, shared, est_gib, margin_gib, shards
    caps: {mode, mem_limit_mib, thread_percentage, fraction, reason}
    start, end, duration_s: float            # Unix seconds
    ttfk_s: float | None                      # None: no process ever seen (or agent down throughout)
    gpus: {index: {energy_j, share_j, active_s, peak_bytes}}   # energy_j: whole-device delta
    series: {index: [[t, gpu_used_bytes, job_bytes, smact], ...]}
    exit_code: int | None; state: str | None # from Slurm's JSON while the job is completing
    registered_by, closed_by: "agent" | "prolog" | "epilog"
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator

from gpushare.epilog.ledger import Ledger
from gpushare.node.jobs import RECORD_VERSION
from gpushare.atomic import read_json_object, write_json_atomic

# <node>.<job>.<restarts>.json; the node part is optional: records written before the node was named
_NAME_RE = re.compile(r"^(?:([A-Za-z0-9][A-Za-z0-9_-]{0,99})\.)?(\d{1,10}(?:_\d{1,10})?)\.(\d{1,7})\.json$")


class RecordLedger:
    """A directory of per-run job records plus ``history.jsonl``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self._history = Ledger(self.dir)

    def ensure(self) -> "RecordLedger":
        self._history.ensure()  # real directory, root's when we are root, no symlinks
        os.chmod(self.dir, 0o755)
        return self

    def path(self, job: str, restarts: int, node: str = "") -> Path:
        """The file of one run on one node (``node`` empty: the older name without it)."""
        name = f"{node + '.' if node else ''}{job}.{int(restarts)}.json"
        match = _NAME_RE.match(name)
        if not match or match.group(2) != str(job):
            raise ValueError(f"bad record key: node {str(node)[:30]!r}, job {str(job)[:30]!r}, restarts {restarts!r}")
        return self.dir / name

    def put(self, record: dict[str, Any]) -> Path:
        """Write one record (replacing an earlier write of the same run on the same node) and index it.

        A node name that cannot be part of a file name (Slurm allows dots) gives the older name without it."""
        self.ensure()
        job, restarts, node = str(record["job"]), int(record.get("restarts", 0)), str(record.get("node") or "")
        try:
            target = self.path(job, restarts, node)
        except ValueError:
            target = self.path(job, restarts)
        write_json_atomic(target, record, mode=0o644)
        self._history.append_history({"event": "record", "job": str(record["job"]),
                                      "restarts": int(record.get("restarts", 0)), "end": record.get("end")})
        return target

    def get(self, job: str, restarts: int | None = None) -> list[dict[str, Any]]:
        """The records of one job (every run, oldest first; a multi-node run has one per node), or of one run.
        Files of both names are read: ``<node>.<job>.<restarts>.json`` and the older ``<job>.<restarts>.json``."""
        self.path(job, 0)  # validates the id before it becomes part of a glob
        if not self.dir.is_dir():
            return []
        wanted = "*" if restarts is None else str(int(restarts))
        paths = [*self.dir.glob(f"{job}.{wanted}.json"), *self.dir.glob(f"*.{job}.{wanted}.json")]
        found = []
        for path in sorted(set(paths)):
            match = _NAME_RE.match(path.name)
            if match and match.group(2) == job:
                record = self._load(path)
                if record:
                    found.append(record)
        return sorted(found, key=lambda r: (int(r.get("restarts", 0)), str(r.get("node") or "")))

    def all(self, since: float | None = None) -> Iterator[dict[str, Any]]:
        """Every record (ending at or after ``since``), in end-time order."""
        if not self.dir.is_dir():
            return iter(())
        records = []
        for path in self.dir.iterdir():
            if _NAME_RE.match(path.name):
                record = self._load(path)
                if record and (since is None or float(record.get("end") or 0) >= since):
                    records.append(record)
        return iter(sorted(records, key=lambda r: (float(r.get("end") or 0), str(r.get("job")))))

    def history(self) -> list[dict[str, Any]]:
        return self._history.history()

    @staticmethod
    def _load(path: Path) -> dict[str, Any] | None:
        try:
            return read_json_object(path, 16 << 20, RECORD_VERSION)
        except OSError:
            return None
