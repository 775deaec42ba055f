"""Test doubles for the executor: an in-memory Slurm for one node and a simulated MIG GPU.

The fake Slurm behaves like the measured 22.05 (gpushare.mig_manager.slurm_actions): written files change
nothing until ``restart``; a drain survives restarts; the Reason is kept verbatim. ``reconfigure="applies"``
makes it a 24.11+ release, where ``scontrol reconfigure`` applies the files; ``"ignored"`` one where the
release should but Slurm still shows the old layout (the executor must then restart).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from gpushare.gres.sim_backend import SimBackend
from gpushare.mig_manager.device_ops import create_instance
from gpushare.mig_manager.journal import JournalStore, Op
from gpushare.mig_manager.slurm_actions import NodeStatus

NODE = "n1"


class FakeSlurm:
    """slurmctld's view of one node plus the files the executor writes."""

    def __init__(self, gres: str = "gpu:7g.40gb:1", reconfigure: str = "unsupported") -> None:
        self.reconfigure_mode = reconfigure
        self.ctld_gres = gres
        self.file_gres = gres
        self.lines: list[str] = []
        self.drained = False
        self.reason = ""
        self.jobs: dict[str, Counter[str]] = {}
        self.events: list[str] = []

    def status(self, node: str) -> NodeStatus:
        return NodeStatus("IDLE+DRAIN" if self.drained else "IDLE", self.reason if self.drained else "",
                          self.ctld_gres)

    def drain(self, node: str, reason: str) -> None:
        self.drained, self.reason = True, reason
        self.events.append("drain")

    def resume(self, node: str) -> None:
        self.drained, self.reason = False, ""
        self.events.append("resume")

    def running_gpu_jobs(self, node: str) -> dict[str, Counter[str]]:
        return {k: Counter(v) for k, v in self.jobs.items()}

    def write_gres(self, node: str, lines: list[str], gres: str) -> bool:
        changed = (lines, gres) != (self.lines, self.file_gres)
        self.lines, self.file_gres = list(lines), gres
        self.events.append("write")
        return changed

    def reconfigure(self) -> bool:
        if self.reconfigure_mode == "unsupported":
            return False
        if self.reconfigure_mode == "applies":
            self.ctld_gres = self.file_gres
        self.events.append("reconfigure")
        return True

    def restart(self, node: str) -> None:
        self.ctld_gres = self.file_gres
        self.events.append("restart")


def sim_gpu(layout: tuple[tuple[str, int], ...] = (("7g.40gb", 0),), model: str = "a100-40gb") -> SimBackend:
    """One MIG-mode GPU in memory with the given instances (each with its compute instance)."""
    backend = SimBackend.from_scenario({"version": 1, "name": "mig-exec",
                                        "gpus": [{"model": model, "mig_mode": True}]})
    for profile, start in layout:
        create_instance(backend, Op("create", 0, profile, start))
    return backend


def store(tmp_path: Path) -> JournalStore:
    return JournalStore(tmp_path / "journal")


class FileSlurm(FakeSlurm):
    """The same fake, persisted to a JSON file after every change, so a SIGKILLed process leaves it behind."""

    FIELDS = ("ctld_gres", "file_gres", "lines", "drained", "reason", "events")

    def __init__(self, path: Path, gres: str = "gpu:7g.40gb:1") -> None:
        super().__init__(gres)
        self.path = Path(path)
        if self.path.exists():
            import json

            data = json.loads(self.path.read_text())
            for key in self.FIELDS:
                setattr(self, key, data[key])
        else:
            self._save()

    def _save(self) -> None:
        from gpushare.atomic import write_json_atomic

        write_json_atomic(self.path, {key: getattr(self, key) for key in self.FIELDS})

    def drain(self, node: str, reason: str) -> None:
        super().drain(node, reason)
        self._save()

    def resume(self, node: str) -> None:
        super().resume(node)
        self._save()

    def write_gres(self, node: str, lines: list[str], gres: str) -> bool:
        changed = super().write_gres(node, lines, gres)
        self._save()
        return changed

    def restart(self, node: str) -> None:
        super().restart(node)
        self._save()
