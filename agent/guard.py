"""Per-job memory guarding in the agent: the backstop and the forecaster, fed one sample at a time.

The decisions are the pure policies' (``gpushare.agent.backstop.judge``, ``gpushare.policy.forecast``);
this class only keeps their per-job state between samples and turns verdicts into :class:`Action`
records the agent carries out (``gpushare.agent.enforce``). No I/O, no clock: ``check(now, jobs)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

from gpushare.agent.adopt import RETRY_S
from gpushare.agent.backstop import forecast_record, judge, oom_record, unattributed_record
from gpushare.policy.forecast import ForecastConfig, JobForecaster, decide_action
from gpushare.gpus import MiB

if TYPE_CHECKING:
    from gpushare.config import AgentSection



@dataclass(frozen=True)
class Action:
    kind: str  # "oom" (backstop), "forecast" or "unattributed" (a process of no job on its GPU)
    job: str  # "" for "unattributed"
    gpu: int
    record: dict[str, Any]
    pids: tuple[int, ...] = ()


def cap_of(acc: Any, holders: frozenset[str]) -> tuple[int, str | None]:
    """(the cap the backstop holds a job to now, and for a lane job whether it holds its turn)."""
    lane = None if not acc.lane_cap_bytes else "turn" if acc.job in holders else "off-turn"
    return (acc.lane_cap_bytes if lane == "off-turn" else acc.cap_bytes), lane


@dataclass
class Guard:
    backstop: str = "stop"  # stop | record | none
    tolerance_bytes: int = 512 * MiB
    grace_s: float = 10.0
    forecast_action: str = "warn"  # none | warn | requeue
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    _over: dict[tuple[str, str], float] = field(default_factory=dict)
    _peak: dict[tuple[str, str], float] = field(default_factory=dict)
    _forecasters: dict[tuple[str, str], JobForecaster] = field(default_factory=dict)
    _done: set[str] = field(default_factory=set)  # jobs the backstop acted on
    _strangers: dict[tuple[int, int], float] = field(default_factory=dict)  # (gpu, pid) -> over since
    _held: set[tuple[int, int]] = field(default_factory=set)  # (gpu, pid) recorded as held (failsafe.py)

    @classmethod
    def from_config(cls, cfg: AgentSection) -> "Guard":
        return cls(backstop=getattr(cfg, "backstop", "stop"),
                   tolerance_bytes=int(getattr(cfg, "backstop_tolerance_mib", 512)) * MiB,
                   grace_s=float(getattr(cfg, "backstop_grace_s", 10.0)),
                   forecast_action=getattr(cfg, "forecast_action", "warn"),
                   forecast=ForecastConfig(horizon_s=float(getattr(cfg, "forecast_horizon_s", 120.0)),
                                           window=int(getattr(cfg, "forecast_window", 120)),
                                           confirm=int(getattr(cfg, "forecast_confirm", 5)),
                                           min_samples=min(20, int(getattr(cfg, "forecast_window", 120)))))

    def forget(self, job: str) -> None:
        for table in (self._over, self._peak, self._forecasters):
            for key in [k for k in table if k[0] == job]:
                del table[key]
        self._done.discard(job)

    def check(self, now: float, jobs: Iterable[Any], holders: frozenset[str] = frozenset(),
              crowded: frozenset[int] = frozenset()) -> list[Action]:
        """One pass over the tracked jobs (``JobAcc``); the actions due now.

        ``holders``: the lane jobs holding their lane's turn. A lane job is held to its full cap only while
        it holds the turn; otherwise (waiting, demoted, or never joined its lane) to what it is charged
        (``JobAcc.lane_cap_bytes``): the discount is only safe while its ephemeral memory is given back.
        ``crowded``: GPUs with another job on them and less than the tolerance free. There a job over its
        cap is already taking what its neighbours were promised, so it gets no grace period: it is stopped
        at the first sample that sees it (the grace only spares spikes nobody else pays for)."""
        actions: list[Action] = []
        for acc in jobs:
            if not acc.shared or acc.cap_bytes <= 0 or acc.job in self._done:
                continue
            cap, lane = cap_of(acc, holders)
            for gpu, used in acc.now_bytes.items():
                key = (acc.job, gpu)
                if not acc.now_pids.get(gpu):
                    continue  # no process of the job on this GPU in this sample
                self._peak[key] = max(self._peak.get(key, 0.0), used)
                if self.backstop != "none":
                    grace = 0.0 if int(gpu) in crowded else self.grace_s
                    verdict = judge(used, cap, self.tolerance_bytes, grace, now, self._over.get(key))
                    if verdict.over_since is None:
                        self._over.pop(key, None)
                    else:
                        self._over[key] = verdict.over_since
                    if verdict.state == "act":
                        assert verdict.over_since is not None  # judge() gives "act" only with its start
                        self._done.add(acc.job)
                        record = oom_record(int(gpu), self._peak[key], cap, self.tolerance_bytes,
                                            verdict.over_since, now, self.backstop, lane)
                        actions.append(Action("oom", acc.job, int(gpu), record, tuple(acc.now_pids[gpu])))
                        break
                if self.forecast_action == "none":
                    continue
                forecaster = self._forecasters.setdefault(key, JobForecaster(self.forecast))
                forecaster.observe(now, used)
                fired = forecaster.step(now, acc.cap_bytes)
                action = decide_action(self.forecast_action, fired)
                if fired is not None and action != "none":
                    record = forecast_record(int(gpu), now, acc.cap_bytes, fired.predicted_bytes,
                                             self.forecast.horizon_s, fired.eta_s, fired.trend_bytes_per_s, action)
                    actions.append(Action("forecast", acc.job, int(gpu), record))
        return actions

    def over_now(self, jobs: Iterable[Any], holders: frozenset[str], found: dict[int, list[Any]]) -> list[tuple[str, int]]:
        """(offender, GPU) of every job and unattributed process over its cap + tolerance in this sample,
        grace or not: the moments a neighbour on that GPU may fail to allocate through no fault of its
        own (the agent marks those neighbours, ``Watch._mark_collateral``)."""
        over = []
        for acc in jobs:
            cap, _ = cap_of(acc, holders)
            if not acc.shared or cap <= 0:
                continue
            over += [(acc.job, int(gpu)) for gpu, used in acc.now_bytes.items()
                     if acc.now_pids.get(gpu) and used > cap + self.tolerance_bytes]
        for gpu, strangers in found.items():
            over += [(f"uid {s.uid} pid {s.pid}", gpu) for s in strangers if s.used_bytes > self.tolerance_bytes]
        return over

    def check_unattributed(self, now: float, found: dict[int, list[Any]],
                           hold: Callable[[Any], str | None] = lambda stranger: None) -> list[Action]:
        """Processes that belong to no job on their GPU (``sampler.Stranger``, per GPU): each one's cap is
        nothing, so one holding more than the tolerance past the grace period is acted on like a job over
        its cap. A process claiming a job the agent does not track yet gets the adoption retry period on
        top (``gpushare.agent.adopt``: a job whose Prolog did not run is registered within it).

        ``hold(stranger)``: why it must not be stopped now (``gpushare.agent.failsafe``); such a process is
        recorded once (``action: "hold"``) and stopped later only if it is still over once nothing holds."""
        seen: set[tuple[int, int]] = set()
        actions: list[Action] = []
        for gpu, strangers in found.items():
            for stranger in strangers:
                key = (gpu, stranger.pid)
                seen.add(key)
                if self.backstop == "none" or key in self._strangers and self._strangers[key] < 0:
                    continue  # off, or already acted on (marked with a negative time)
                grace = self.grace_s + (RETRY_S if stranger.claim is not None else 0.0)
                # a cap of one byte: judge() reads 0 as "no cap known"
                verdict = judge(stranger.used_bytes, 1.0, self.tolerance_bytes, grace, now, self._strangers.get(key))
                if verdict.over_since is None:
                    self._strangers.pop(key, None)
                    continue
                self._strangers[key] = verdict.over_since
                if verdict.state == "act":
                    held = hold(stranger) if self.backstop == "stop" else None
                    if held is not None and key in self._held:
                        continue  # recorded once while held
                    record = unattributed_record(gpu, stranger.pid, stranger.uid, stranger.claim,
                                                 stranger.used_bytes, self.tolerance_bytes, verdict.over_since,
                                                 now, "hold" if held is not None else self.backstop)
                    if held is not None:
                        record["held"] = held
                        self._held.add(key)
                    else:
                        self._strangers[key] = -1.0
                    actions.append(Action("unattributed", "", gpu, record, (stranger.pid,)))
        for key in set(self._strangers) - seen:  # gone: forget it (a reused pid starts afresh)
            del self._strangers[key]
        self._held &= seen
        return actions
