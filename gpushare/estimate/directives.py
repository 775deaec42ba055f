"""``#GPUSHARE`` directives in a batch script: the user's way to hand the submit hook an estimate.

Why a directive: ``sbatch`` keeps the whole script, and job_submit can read it, so a line such as
``#GPUSHARE mem=12G``, ``#GPUSHARE est=a100-40gb/5243M``, ``#GPUSHARE estimate=est.json`` or ``#GPUSHARE lanes``
travels with the job without new sbatch flags.

``est=`` is a gpu-estimate result carried in the script itself (``gpu-estimate --annotate`` writes it): per target
GPU ``NAME/TOTAL[/PERSISTENT/EPHEMERAL]``, comma-separated, sizes with a unit (``M`` when none). Why inline: the
script reaches job_submit on the controller, a file path does not: on a cluster whose homes the controller's root
cannot read (root squash, 0700 homes, home not mounted there), ``estimate=path`` can only be refused.

Scripts are hostile input here (they reach a root-run service): lines are scanned only within the
configured byte limit, values are length-capped, and every problem is reported with its line number
instead of raising.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpushare.config import parse_size
from gpushare.estimate.schema import PLAUSIBLE_MAX_BYTES, parse_inline

MAX_GPU_MEMORY = PLAUSIBLE_MAX_BYTES
_DIRECTIVE_RE = re.compile(r"^\s*#\s*GPUSHARE\b(.*)$", re.IGNORECASE)
_KEYS = ("mem", "est", "estimate", "script", "mode", "lanes", "compute")



@dataclass
class Directives:
    """What the script asked for; ``problems`` holds (line number, message) pairs."""

    mem_bytes: int | None = None
    inline: list[dict[str, int | str]] | None = None  # est=: targets as gpu-estimate's JSON has them
    estimate_path: str | None = None
    script: str | None = None
    mode: str | None = None  # "exclusive" or "shared": the user's own override
    lanes: bool = False  # ``#GPUSHARE lanes`` (or lanes=yes): Salus lanes, turns per iteration (docs/agent.md)
    compute: str | None = None  # "light", "medium" or "heavy": how busy the job keeps a GPU's SMs
    problems: list[tuple[int, str]] = field(default_factory=list)
    lines: dict[str, int] = field(default_factory=dict)  # key -> line number, for messages

    @property
    def first_problem(self) -> str | None:
        if not self.problems:
            return None
        line, message = self.problems[0]
        return f"#GPUSHARE on line {line}: {message}"


def parse_directives(script: str, max_bytes: int = 65536) -> Directives:
    """Collect ``#GPUSHARE key=value`` settings; a later line overrides an earlier one."""
    found = Directives()
    for number, raw in enumerate(script[:max_bytes].splitlines(), start=1):
        match = _DIRECTIVE_RE.match(raw)
        if not match:
            continue
        body = match.group(1).strip()
        if not body:
            found.problems.append((number, "empty directive (expected e.g. mem=12G)"))
            continue
        for token in body.split():
            if token.startswith("#"):
                break  # trailing comment
            _apply(found, number, token)
    return found


def _apply(found: Directives, number: int, token: str) -> None:
    key, sep, value = token.partition("=")
    key = key.lower()
    if key == "lanes" and not sep:
        token, sep, value = "lanes=yes", "=", "yes"  # the bare flag
    if not sep or not value:
        found.problems.append((number, f"expected key=value, got {token[:60]!r}"))
        return
    if key not in _KEYS:
        found.problems.append((number, f"unknown key {key[:30]!r} (known: {', '.join(_KEYS)})"))
        return
    if len(value) > 4096:
        found.problems.append((number, f"{key}: value longer than 4096 characters"))
        return
    found.lines[key] = number
    if key == "mem":
        try:
            size = parse_size(value, default_unit="G")
        except ValueError as exc:
            found.problems.append((number, f"mem: {exc}"))
            return
        if size <= 0 or size > MAX_GPU_MEMORY:
            found.problems.append((number, f"mem: {value[:30]!r} is not a plausible GPU memory size"))
            return
        found.mem_bytes = size
    elif key == "est":
        targets = parse_inline(value)
        if isinstance(targets, str):
            found.problems.append((number, f"est: {targets}"))
            return
        found.inline = targets
    elif key == "estimate":
        found.estimate_path = value
    elif key == "script":
        found.script = value
    elif key == "mode":
        if value.lower() not in ("exclusive", "shared"):
            found.problems.append((number, f"mode: expected exclusive or shared, got {value[:30]!r}"))
            return
        found.mode = value.lower()
    elif key == "lanes":
        if value.lower() not in ("yes", "no"):
            found.problems.append((number, f"lanes: expected yes or no, got {value[:30]!r}"))
            return
        found.lanes = value.lower() == "yes"
    elif key == "compute":
        if value.lower() not in ("light", "medium", "heavy"):
            found.problems.append((number, f"compute: expected light, medium or heavy, got {value[:30]!r}"))
            return
        found.compute = value.lower()

