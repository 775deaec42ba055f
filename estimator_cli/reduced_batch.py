"""Reduced-batch profile: when the full batch does not fit ``--max-cpu-memory``, measure smaller ones and
extrapolate (docs/estimator.md, "Reduced-batch extrapolation").

Profile mode runs the real model on the CPU, so a batch that needs 60 GiB on the GPU needs about as much
host memory. Training memory is close to affine in the batch size — parameters, gradients and optimizer
state do not depend on it, activations grow with it — so a few profiles at smaller batches, fitted with
``peak ≈ a + k·batch``, predict the full batch. The caching allocator rounds blocks and segments, which
makes the true curve piecewise; the uncertainty reported with the estimate covers that rounding and the
disagreement between the measured points, and it is *added* to the estimate the scheduler uses, so the
job is not sized below what the fit allows.

Two halves, because a capture runs in a child process (estimator_cli/runner.py):

- child side, :class:`BatchKnob`: the batch is reduced inside the unmodified script, in one of two ways.
  First an ``argparse`` argument with a recognised batch spelling (:data:`BATCH_OPTIONS`), whether the
  user passed it or left its default: ``parse_known_args`` is wrapped and the parsed value divided.
  Otherwise, when no such argument was parsed, the ``batch_size`` given to ``torch.utils.data.DataLoader``.
  Either way the child reports the full and reduced values, so the parent learns the full batch even
  when it is an argparse default it never saw.
- parent side, :func:`capture_series` and :func:`extrapolate_targets`: the schedule of reduced runs and the
  fit per target.

What cannot be reduced — a batch size hard-coded in tensor shapes, read from a config file, or parsed by
something other than argparse and not fed through a DataLoader — leaves the knob unused, and the original
memory-limit failure (exit 4) stands.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable

# Option strings of argparse arguments taken to be the (per-device, per-step) batch size. `-b` only counts
# when its parsed value is an int, like all of them.
BATCH_OPTIONS = frozenset({
    "--batch-size", "--batch_size", "--batchsize", "--bs", "-b", "--bsz",
    "--per_device_train_batch_size", "--per-device-train-batch-size",
    "--train_batch_size", "--train-batch-size", "--micro_batch_size", "--micro-batch-size",
})

MAX_POINTS = 3  # measured batches: the two largest make the fit, the third checks it


@dataclass
class BatchKnob:
    """Child side: divides the script's batch size by ``divisor`` (1: only observes which knob exists)."""

    divisor: int
    knob: str | None = None  # e.g. "argument --batch-size" or "DataLoader(batch_size=...)"
    full: int | None = None  # the batch size the script asked for (first one seen)
    used: int | None = None  # what it got instead
    produced: set[int] = field(default_factory=set)  # reduced DataLoader sizes (a framework may re-create one)
    _seen: set[tuple[int, str]] = field(default_factory=set)  # (id(namespace), dest): subparsers parse twice

    def reduce(self, value: int) -> int:
        return max(1, value // self.divisor)

    def _record(self, knob: str, full: int, used: int) -> None:
        if self.knob is None:
            self.knob, self.full, self.used = knob, full, used

    def after_parse(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> None:
        """Reduce each recognised batch argument of one parsed namespace (once per namespace)."""
        for action in parser._actions:  # noqa: SLF001 - argparse has no public list of its arguments
            spelling = next((s for s in action.option_strings if s in BATCH_OPTIONS), None)
            if spelling is None or (id(namespace), action.dest) in self._seen:
                continue
            value = getattr(namespace, action.dest, None)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                continue
            self._seen.add((id(namespace), action.dest))
            used = self.reduce(value)
            setattr(namespace, action.dest, used)
            self._record(f"argument {spelling}", value, used)

    def dataloader_batch(self, batch_size: Any) -> Any:
        """The batch size a DataLoader gets: reduced when no argparse argument was, and not already reduced."""
        if (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 1
                or (self.knob is not None and self.knob.startswith("argument"))
                or batch_size in self.produced):
            return batch_size
        used = self.reduce(batch_size)
        if self.divisor > 1:
            self.produced.add(used)
        self._record("DataLoader(batch_size=...)", batch_size, used)
        return used

    def to_json(self) -> dict[str, Any]:
        return {"knob": self.knob, "full": self.full, "used": self.used, "divisor": self.divisor}


def install(divisor: int) -> BatchKnob:
    """Wrap ``argparse.ArgumentParser.parse_known_args`` and ``DataLoader.__init__`` in this (child)
    process. Called after the runner parsed its own arguments; the process ends with the capture."""
    from torch.utils.data import DataLoader

    knob = BatchKnob(divisor)
    parse_known = argparse.ArgumentParser.parse_known_args
    loader_init = DataLoader.__init__

    def parse_known_args(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        parsed, rest = parse_known(self, args, namespace)
        knob.after_parse(self, parsed)
        return parsed, rest

    def init(self: Any, dataset: Any, *args: Any, **kwargs: Any) -> None:
        if "batch_size" in kwargs:
            kwargs["batch_size"] = knob.dataloader_batch(kwargs["batch_size"])
        elif args:
            args = (knob.dataloader_batch(args[0]), *args[1:])
        loader_init(self, dataset, *args, **kwargs)

    argparse.ArgumentParser.parse_known_args = parse_known_args  # type: ignore[method-assign,assignment]
    DataLoader.__init__ = init  # type: ignore[method-assign]
    return knob


# ---------------------------------------------------------------------------------------------- parent side


@dataclass
class Point:
    """One measured batch: its size and the per-target numbers of its replay."""

    batch: int
    outcome: Any  # launcher.CaptureOutcome


def schedule(full: int) -> list[int]:
    """Divisors to try, largest batch first: halving until the batch is 1."""
    out, d = [], 2
    while full // d >= 1:
        out.append(d)
        d *= 2
    return out


def capture_series(full_batch: int, capture: Callable[[int], Any], note: Callable[[str], None]) -> list[Point]:
    """Profiles at reduced batches: halve until one fits the memory limit, then up to two smaller ones.

    ``capture(divisor)`` runs one profile-mode capture and returns a ``CaptureOutcome`` or raises
    ``CaptureFailed``. A smaller batch that fails (the script may require a minimum batch) ends the
    series with what was measured; the caller decides whether that is enough (two points). Running out of
    ``--timeout`` before two points is reported as the timeout it is."""
    from gpushare.estimator_cli.launcher import CaptureFailed

    points: list[Point] = []
    for divisor in schedule(full_batch):
        if len(points) >= MAX_POINTS:
            break
        note(f"reduced batch: trying 1/{divisor} of {full_batch}")
        try:
            outcome = capture(divisor)
        except CaptureFailed as exc:
            if exc.status == "limit" and not points:
                continue  # still too large: halve again
            if exc.status == "timeout" and len(points) < 2:
                raise  # out of time: say so, not that the memory limit was hit
            break
        used = (outcome.batch or {}).get("used")
        if not isinstance(used, int) or outcome.batch.get("knob") is None:
            break  # nothing was reduced this time: the series cannot be trusted
        if not points or used < points[-1].batch:
            points.append(Point(used, outcome))
    return points


@dataclass
class Line:
    """``value ≈ at_largest + slope·(batch - largest)``: the fit through the two largest batches."""

    slope: float
    largest: int
    at_largest: int

    def at(self, batch: int) -> int:
        return int(round(self.at_largest + self.slope * (batch - self.largest)))


def fit(points: list[tuple[int, int]]) -> Line:
    """Line through the two largest batches (closest to the extrapolation); slope clamped at >= 0, since
    more samples never need less memory."""
    ordered = sorted(points)
    (b1, v1), (b2, v2) = ordered[-2], ordered[-1]
    return Line(max(0.0, (v2 - v1) / (b2 - b1)), b2, v2)


def spread(points: list[tuple[int, int]], full: int) -> int | None:
    """Largest disagreement at ``full`` between the chosen fit and the lines through the other pairs of
    points; None with only two points (nothing to check the fit against)."""
    if len(points) < 3:
        return None
    main = fit(points).at(full)
    worst = 0
    ordered = sorted(points)
    for i in range(len(ordered)):
        for j in range(i + 1, len(ordered)):
            pair = [ordered[i], ordered[j]]
            if pair == ordered[-2:]:
                continue
            worst = max(worst, abs(fit(pair).at(full) - main))
    return worst


def uncertainty(points: list[tuple[int, int]], full: int, granularity: int) -> tuple[int, str]:
    """Bytes to add to the extrapolated reserved peak, and how they were found.

    The allocator reserves memory in segments, so two batches on the same line can differ by up to one
    large segment (``granularity``); that is always included. With a third point, the disagreement of the
    lines through the other pairs is added. With two points only, a quarter of the extrapolated growth
    stands in for the check that could not be made."""
    found = spread(points, full)
    if found is not None:
        return found + granularity, "spread of the pairwise fits + one allocator segment"
    line = fit(points)
    growth = max(0, line.at(full) - line.at_largest)
    return growth // 4 + granularity, "two points only: a quarter of the extrapolated growth + one allocator segment"


def extrapolate_target(target: dict[str, Any], measured: list[tuple[int, dict[str, Any]]], full: int,
                       granularity: int, recommend_for: Callable[[int, bool], Any]) -> dict[str, Any]:
    """The target document at the full batch from its documents at the measured batches.

    ``target`` is the document of the largest measured batch (its breakdowns are kept as measured there);
    ``recommend_for(peak_total, oom)`` re-runs the recommendation for the extrapolated peak."""
    def series(key: str) -> list[tuple[int, int]]:
        return [(b, int(t[key])) for b, t in measured]

    reserved_pts = series("peak_reserved_bytes")
    central = max(fit(reserved_pts).at(full), reserved_pts[-1][1] if reserved_pts else 0)
    extra, method = uncertainty(reserved_pts, full, granularity)
    reserved = central + extra
    allocated = min(reserved, max(fit(series("peak_allocated_bytes")).at(full) + extra, 0))
    out = dict(target)
    out["peak_reserved_bytes"] = int(reserved)
    out["peak_allocated_bytes"] = int(allocated)
    total = reserved + int(target["context_bytes"]) + int(target["other_driver_bytes"])
    out["peak_total_bytes"] = int(total)
    oom = any(bool(t["oom"]) for _, t in measured)
    rec = recommend_for(total, oom)
    out["oom"] = oom
    out["fits"] = not oom and total <= int(target["capacity_bytes"])
    out["share_of_gpu"] = round(total / int(target["capacity_bytes"]), 4)
    out["recommendation"] = rec.to_json()
    if "persistent_bytes" in target:
        persistent = min(reserved, max(0, fit(series("persistent_bytes")).at(full)))
        out["persistent_bytes"] = int(persistent)
        out["ephemeral_bytes"] = int(reserved - persistent)
        out["persistent_allocated_bytes"] = int(min(persistent, max(0, fit(series(
            "persistent_allocated_bytes")).at(full))))
    out["extrapolation"] = {
        "measured": [{"batch": b, "peak_allocated_bytes": int(t["peak_allocated_bytes"]),
                      "peak_reserved_bytes": int(t["peak_reserved_bytes"]),
                      "peak_total_bytes": int(t["peak_total_bytes"])} for b, t in measured],
        "slope_bytes_per_sample": int(round(fit(reserved_pts).slope)),
        "extrapolated_reserved_bytes": int(central),
        "extrapolated_total_bytes": int(central + target["context_bytes"] + target["other_driver_bytes"]),
        "uncertainty_bytes": int(extra),
        "uncertainty_method": method,
    }
    return out


@dataclass
class Series:
    """The reduced-batch profiles of one capture group, ascending by batch."""

    knob: str
    full: int
    points: list[Point]
    reason: str  # the full batch's failure


def run_series(exc: Any, capture: Callable[[int], Any], note: Callable[[str], None]) -> Series:
    """Reduced-batch profiles after the full batch hit the memory limit in profile mode, or ``exc`` again
    (a ``CaptureFailed``, its message extended with why no extrapolation was possible)."""
    from gpushare.estimator_cli.launcher import CaptureFailed

    if exc.status != "limit" or exc.mode != "profile":
        raise exc
    batch = exc.batch or {}
    knob, full = batch.get("knob"), batch.get("full")

    def fail(why: str) -> CaptureFailed:
        return CaptureFailed("limit", f"{exc}; {why}", exc.traceback_tail, exc.output, exc.mode,
                             exc.fallback_reason, exc.batch)

    if knob is None or not isinstance(full, int):
        raise fail("no batch size to reduce was found (an argparse argument such as --batch-size, or "
                   "DataLoader(batch_size=...)), so no reduced-batch estimate could be made either") from exc
    if full < 2:
        raise fail(f"the batch ({knob}) is already {full}") from exc
    points = capture_series(full, capture, note)
    if len(points) < 2:
        measured = ", ".join(str(p.batch) for p in points) or "none"
        raise fail(f"reduced-batch profiles ({knob}, full batch {full}) fitting the limit: {measured}; "
                   "at least two are needed to extrapolate") from exc
    return Series(str(knob), full, sorted(points, key=lambda p: p.batch), str(exc))


def apply_series(doc: dict[str, Any], targets: list[str], groups: list[Any], series: dict[Any, Series],
                 cfg: Any, granularity: int) -> None:
    """Replace the documents of the targets whose capture group was measured at reduced batches by their
    extrapolation to the full batch, and describe the series in ``doc["reduced_batch"]``."""
    from gpushare.estimator_cli.device_model import device_for
    from gpushare.estimator_cli.estimate import estimate_target
    from gpushare.estimator_cli.recommend import recommend
    from gpushare.estimator_cli.report import target_json

    used: Series | None = None
    for i, (name, group) in enumerate(zip(targets, groups)):
        found = series.get(group)
        if found is None:
            continue
        used = used or found
        device = device_for(name, cfg.gpus)
        measured = [(p.batch, dict(target_json(estimate_target(p.outcome.capture, name, cfg))))
                    for p in found.points]

        def recommend_for(total: int, oom: bool, device: Any = device) -> Any:
            return recommend(total, device.model, device.mig_profile, cfg.policy, oom)

        doc["targets"][i] = extrapolate_target(measured[-1][1], measured, found.full, granularity, recommend_for)
    if used is not None:
        doc["reduced_batch"] = {
            "knob": used.knob, "full_batch": used.full, "measured_batches": [p.batch for p in used.points],
            "reason": used.reason,
            "fit": "peak ≈ a + k·batch through the two largest measured batches, extrapolated to the full "
                   "batch; peak_* fields include the uncertainty (targets[].extrapolation)",
        }
