"""Per-job memory guarding in the agent: the backstop and the forecaster, fed one sample at a time.

The decisions are the pure policies' (``gpushare.agent.backstop.judge``, ``gpushare.agent.forecast``);
this class only keeps their per-job state between samples and turns verdicts into :class:`Action`
records the agent carries out (``gpushare.agent.enforce``). No I/O, no clock: ``check(now, jobs)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from gpushare.agent.backstop import forecast_record, judge, oom_record
from gpushare.agent.forecast import ForecastConfig, JobForecaster, decide_action

if TYPE_CHECKING:
    from gpushare.config import AgentSection

MiB = 1 << 20


@dataclass(frozen=True)
class Action:
    kind: str  # "oom" (backstop) or "forecast"
    job: str
    gpu: int
    record: dict[str, Any]
    pids: tuple[int, ...] = ()


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

    def check(self, now: float, jobs: Iterable[Any]) -> list[Action]:
        """One pass over the tracked jobs (``JobAcc``); the actions due now."""
        actions: list[Action] = []
        for acc in jobs:
            if not acc.shared or acc.cap_bytes <= 0 or acc.job in self._done:
                continue
            for gpu, used in acc.now_bytes.items():
                key = (acc.job, gpu)
                if not acc.now_pids.get(gpu):
                    continue  # no process of the job on this GPU in this sample
                self._peak[key] = max(self._peak.get(key, 0.0), used)
                if self.backstop != "none":
                    verdict = judge(used, acc.cap_bytes, self.tolerance_bytes, self.grace_s, now, self._over.get(key))
                    if verdict.over_since is None:
                        self._over.pop(key, None)
                    else:
                        self._over[key] = verdict.over_since
                    if verdict.state == "act":
                        assert verdict.over_since is not None  # judge() gives "act" only with its start
                        self._done.add(acc.job)
                        record = oom_record(int(gpu), self._peak[key], acc.cap_bytes, self.tolerance_bytes,
                                            verdict.over_since, now, self.backstop)
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
