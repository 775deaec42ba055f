"""The agent's jobs: the job store with its fail-open memory, registration and closing, and the MPS daemons.

Why the agent keeps entries in memory: while the store cannot be written (a full disk) each registered job's
entry is kept here, the job is watched from memory, and the entry is written at the first flush the disk
takes again. The locks are the agent's (``gpushare.agent.daemon`` gives their order); the MPS lock is this
part's own, taken after the agent's lock and never before it.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from gpushare.agent.guard import Action
from gpushare.gres import GpuError
from gpushare.node.jobs import build_entry, clean_facts, mps_corunners, tenants_of
from gpushare.node.store import STORE_VERSION, check_job
from gpushare.policy.observe import cap_message

if TYPE_CHECKING:
    from gpushare.agent.daemon import Agent

log = logging.getLogger("gpushare.agent")


def merged(fields: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A store update that sets ``fields`` on the entry (bound now, not when the loop variable moves on)."""
    return lambda entry: {**entry, **fields}


class JobRegistry:
    """The jobs the agent tracks: their store entries (on disk, or in memory while the disk refuses them)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.cfg, self.backend, self.clock, self.lock = agent.cfg, agent.backend, agent.clock, agent.lock
        self.store, self.sampler, self.lanes = agent.store, agent.sampler, agent.lanes
        self._mps_lock = threading.Lock()  # MPS daemon starts and stops, taken after the agent's lock, never before
        self._unsaved: dict[str, dict[str, Any]] = {}
        self._store_error: str | None = None  # set from the first failed write until one succeeds: said once
        self.last_flush = agent.clock()

    def known(self, job: str) -> dict[str, Any] | None:
        """A job's entry from the store, else the one kept in memory while the disk refused it (None: neither)."""
        return self.store.get(job) or self._unsaved.get(job)

    def flush(self) -> None:
        """Persist every running job's accumulators (a crash loses at most one flush period). A full disk
        fails open: the jobs stay watched from memory and are written at the first flush it takes again."""
        with self.lock:
            wrote = False
            for acc in list(self.sampler.jobs.values()):
                try:
                    unsaved = self._unsaved.get(acc.job)
                    if unsaved is not None:  # never written: the whole entry, durably, under its lock
                        with self.store.locked(acc.job):
                            self.store.put({**unsaved, **acc.fields()})
                        del self._unsaved[acc.job]
                        wrote = True
                    else:
                        wrote = self.store.update(acc.job, merged(acc.fields()), durable=False) is not None or wrote
                except OSError as exc:
                    self._store_failed(exc)
            if wrote:
                self._store_writable()
            self.last_flush = self.clock()

    def entry(self, job: str) -> dict[str, Any]:
        """A job's entry: the store's, or the one kept in memory while the disk refused it ({}: neither)."""
        return self.store.get(job) or self._unsaved.get(job) or {}

    def update(self, job: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> dict[str, Any] | None:
        """``JobStore.update`` that fails open: an entry kept in memory is changed there (and written at the
        next flush the disk takes), a write the disk refuses is said once and the change kept in memory."""
        unsaved = self._unsaved.get(job)
        if unsaved is None:
            try:
                return self.store.update(job, change)
            except OSError as exc:
                self._store_failed(exc)
                unsaved = self.store.get(job)
                if unsaved is None:
                    return None
        changed = change(dict(unsaved))
        self._unsaved[job] = changed if changed is not None else unsaved
        return self._unsaved[job]

    def _store_failed(self, exc: OSError) -> None:
        """One line when the job store stops taking writes (not one per flush); jobs go on being watched."""
        if self._store_error is None:
            log.error("job store not writable (%s: %s): running jobs are watched from memory, their records go "
                      "to the Epilog from the agent, and entries are written when the disk takes them again",
                      self.store.dir, exc.strerror or exc)
        self._store_error = exc.strerror or str(exc)

    def _store_writable(self) -> None:
        if self._store_error is not None:
            log.warning("job store writable again (%s); %d job(s) still waiting to be written",
                        self.store.dir, len(self._unsaved))
            self._store_error = None

    def _ensure_mps(self, entry: dict[str, Any]) -> bool:
        """Start the MPS daemon an MPS job needs; False when it cannot run (the job must not use MPS)."""
        if (entry.get("caps") or {}).get("mode") != "mps":
            return True
        gpu = entry["gpus"][0]
        try:
            with self._mps_lock:
                if not self.agent.mps.running(gpu):
                    self.agent.mps.start(gpu)
                    log.info("MPS control daemon started for GPU %d", gpu)
            return True
        except GpuError as exc:
            log.error("MPS for GPU %d: %s; jobs there get the memory-fraction guard instead", gpu, exc)
            return False

    def _stop_idle_mps(self, gpus: list[int]) -> None:
        for gpu in gpus:
            if any(acc.mode == "mps" for acc in self.sampler.jobs_on(gpu)):
                continue
            try:
                with self._mps_lock:
                    if self.agent.mps.running(gpu):
                        self.agent.mps.stop(gpu)
            except GpuError as exc:
                log.error("MPS stop for GPU %d: %s", gpu, exc)

    def register(self, raw: dict[str, Any], by: str = "agent") -> dict[str, Any]:
        """Track a job the Prolog announces (or the agent adopts). Starting an MPS daemon (up to tens of
        seconds) happens outside the sampling lock: the Prolog waits only a few seconds, and other jobs'
        Prologs and the sampling loop must not queue behind one slow MPS start. An adopted job is already
        running without an MPS pipe: it never gets one."""
        facts = clean_facts(raw)
        adopted = by == "agent-adopted"
        with self.lock:
            existing = self.known(facts["job"])
            if existing is not None and not existing.get("closed") and existing.get("restarts") == facts["restarts"]:
                self.sampler.track(existing)  # a Prolog retried: idempotent
                self.agent.watch.withhold(self.clock())
                return existing
            entries = self.store.all()
            tenants = tenants_of(entries, facts["gpus"], facts["job"])
            corunners = mps_corunners(entries, facts["gpus"], facts["job"])
            entry = build_entry(facts, self.cfg, self.backend, tenants, self.clock(), by=by, mps_ok=not adopted,
                                corunners=corunners)
        mps_ok = adopted or self._ensure_mps(entry)  # its own lock; never hand out an MPS pipe in vain
        with self.lock:
            if not mps_ok:
                entry = build_entry(facts, self.cfg, self.backend, tenants, self.clock(), by=by, mps_ok=False)
            if adopted:  # its start was not seen: no TTFK, and its GPU is not "warming" for it
                entry = {**entry, "kernel_at": entry["start"], "ttfk_source": "adopted",
                         "caps": {**entry["caps"], "reason": "adopted running (its Prolog did not run): backstop only"}}
            try:
                self.store.put(entry)
                self._unsaved.pop(entry["job"], None)
                self._store_writable()
            except OSError as exc:  # a full disk: the job runs with its caps, watched from memory
                self._store_failed(exc)
                self._unsaved[entry["job"]] = {**entry, "v": STORE_VERSION}
            self.sampler.track(entry)
            self.agent.watch.withhold(self.clock())
            if entry.get("would_mib"):
                log.info("%s", cap_message(entry["job"], int(entry["would_mib"]), int(entry.get("would_shards") or 0)))
            return entry

    def close(self, job: str) -> dict[str, Any] | None:
        """Stop tracking a job; its entry (with final accumulators) stays for the Epilog to record."""
        job = check_job(job)
        with self.lock:
            acc = self.sampler.untrack(job)
            fields = acc.fields() if acc else {}
            unsaved = self._unsaved.pop(job, None)
            entry: dict[str, Any] | None
            try:
                if unsaved is not None:
                    with self.store.locked(job):
                        entry = self.store.put({**unsaved, **fields, "closed": True})
                else:
                    entry = self.store.update(job, lambda e: {**e, **fields, "closed": True})
            except OSError as exc:  # a full disk: the Epilog gets the entry from this answer all the same
                self._store_failed(exc)
                known = unsaved if unsaved is not None else self.store.get(job)
                entry = {**known, **fields, "closed": True} if known is not None else None
            if acc:
                self._stop_idle_mps(acc.gpus)
            self.agent.watch.forget(job)
            self.agent.watch.withhold(self.clock())
        self.lanes.leave(job, "closed by its Epilog")  # after the agent's lock: the lock order (gpushare.agent.daemon)
        return entry

    def load(self) -> int:
        """Pick up every job in the store (after a restart); returns how many."""
        with self.lock:
            entries = [e for e in self.store.ensure().all() if not e.get("closed")]  # closed: awaiting its Epilog
            for entry in entries:
                self.sampler.track(entry)
                self._ensure_mps(entry)
                if self.agent.slurm is not None:  # still running here? asked off the lock (gpushare.agent.restore)
                    self.agent.work.followups.put((Action("verify", entry["job"], 0, {"restarts": entry.get("restarts", 0)}), ""))
            log.info("agent: %d running job(s) restored from %s", len(entries), self.store.dir)
            return len(entries)
