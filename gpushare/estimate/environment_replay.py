"""Which lines of a batch script set up the training's environment, and the shell text that replays them.

Why: a training script imports what the job's environment holds (``module load``, ``source venv/bin/activate``,
``conda activate``), so the asynchronous estimation must run the capture there, under the interpreter the
training command would use. Why only those lines, not the batch script: the rest may do anything (copy
data, start servers, train); environment lines are cheap and meant to be re-run.

Two sides, kept apart:
- :func:`find_environment` runs as **root** in the estimation service on a job-supplied script: pure text
  analysis, bounded (at most ``MAX_LINES`` lines of at most ``MAX_LINE_BYTES`` each), nothing executed.
- :func:`replay_script` writes shell text that runs **as the user**, inside their estimation job (the
  service submits it with ``sbatch --uid``): the user's own lines, in their order, each followed by a note
  of its failure, so nothing there runs with more rights than the user's own batch script has.

Replayed (top level, before the training line): ``module``/``ml``, ``source``/``.``, ``conda``/``mamba``/
``micromamba activate|deactivate``, ``eval "$(conda shell.bash hook)"``, ``export``, ``unset``, ``set``, ``cd``,
``pushd``/``popd``, ``umask``, ``ulimit`` and plain ``NAME=value`` lines. Not replayed: everything else (the
training, data copies, ``srun`` steps), lines after the training line, and lines inside ``if``/``for``/``while``/
``case`` blocks or functions, whose condition cannot be decided here; an *activation* line (module, source,
conda, eval) in such a block makes the environment unreproducible, and the job gets the fallback naming it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field

MAX_LINES = 64  # environment lines replayed; a batch script with more is refused (naming the line)
MAX_LINE_BYTES = 4096

_ACTIVATION = {"module", "ml", "source", ".", "conda", "mamba", "micromamba", "eval"}
_SETTINGS = {"export", "unset", "set", "cd", "pushd", "popd", "umask", "ulimit"}
_ASSIGNMENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_HOOK_RE = re.compile(r"\b(?:conda|mamba|micromamba)\b")  # with "shell" in the line: a shell hook
_OPEN_RE = re.compile(r"(?:^|[;&|(]|\bthen|\bdo|\belse)\s*(if|for|while|until|case|select)\b")
_CLOSE_RE = re.compile(r"(?:^|[;&|]|\s)(fi|done|esac)\b")
_BLOCK_WORD_RE = re.compile(r"\b(?:if|for|while|until|case|select|fi|done|esac)\b")
_FUNCTION_RE = re.compile(r"^(?:function\s+[\w.-]+|[\w.-]+\s*\(\s*\))\s*(?:\(\s*\))?\s*\{?\s*$")
_SHELLS = {"sh", "bash", "dash"}
_SIMPLE_WORD_RE = re.compile(r"^[A-Za-z0-9_./${}+:@%-]+$")  # may carry $VAR / ${VAR}, nothing the shell runs


@dataclass(frozen=True)
class EnvironmentLine:
    number: int
    text: str


@dataclass(frozen=True)
class Environment:
    """The environment lines of a batch script, in order, and how to run them."""

    lines: tuple[EnvironmentLine, ...] = ()
    login: bool = False  # the batch script's shell is a login shell (#!/bin/bash -l)
    notes: tuple[str, ...] = field(default=(), compare=False)

    def text_of(self, number: int) -> str:
        return next((line.text for line in self.lines if line.number == number), "")


@dataclass(frozen=True)
class Unreproducible:
    """The environment cannot be replayed; ``reason`` names the line and is shown to the user."""

    reason: str


def _first_word(text: str) -> str:
    match = re.match(r"^\s*([^\s;&|()<>]+)", text)
    return match.group(1) if match else ""


def _kind(text: str) -> str | None:
    """``activation``, ``setting`` or None (not an environment line)."""
    word = _first_word(text)
    if word in ("conda", "mamba", "micromamba"):
        rest = text.split()[1:2]
        return "activation" if rest and rest[0] in ("activate", "deactivate") else None
    if word == "eval":  # two linear scans; one pattern with ".*" between the names backtracks quadratically
        return "activation" if "shell" in text and _HOOK_RE.search(text) else None
    if word in _ACTIVATION:
        return "activation"
    if word in _SETTINGS:
        return "setting"
    if _ASSIGNMENT_RE.match(word) and len(text.split()) == 1:
        return "setting"
    return None


def _shebang(text: str) -> tuple[str, bool]:
    """The batch script's shell (basename) and whether it is a login shell."""
    first = text.split("\n", 1)[0]
    if not first.startswith("#!"):
        return "sh", False
    words = first[2:].split()
    if words and words[0].endswith("/env"):
        words = words[1:]
    if not words:
        return "sh", False
    login = any(w in ("-l", "--login") or (w.startswith("-") and not w.startswith("--") and "l" in w)
                for w in words[1:])
    return words[0].rsplit("/", 1)[-1], login


_HEREDOC_RE = re.compile(r"<<-?\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)['\"]?")


def joined_lines(text: str, skip_heredoc_bodies: bool = False) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each logical line: backslash continuations joined, blank and comment
    lines dropped; with ``skip_heredoc_bodies`` a here-document's body is skipped (it is data, not commands)."""
    pending, start = "", 0
    heredoc: str | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        line, pending = (pending + stripped).strip(), ""
        if skip_heredoc_bodies and "<<" in line:
            match = _HEREDOC_RE.search(line)
            heredoc = match.group(1) if match else None
        yield start, line
    if pending:
        yield start, pending.strip()

def find_environment(batch_script: str, training_line: int, max_bytes: int = 65536) -> Environment | Unreproducible:
    """The environment lines before ``training_line`` (0: the directive named a script no line runs; then
    every top-level environment line), or why they cannot be replayed."""
    text = batch_script[:max_bytes]
    shell, login = _shebang(text)
    lines: list[EnvironmentLine] = []
    notes: list[str] = []
    depth = 0
    for start, line in joined_lines(text, skip_heredoc_bodies=True):
        if training_line and start >= training_line:
            break
        kind = _kind(line)
        nested = depth > 0
        if _BLOCK_WORD_RE.search(line):  # most lines have none: one scan instead of two
            depth = max(0, depth + len(_OPEN_RE.findall(line)) - len(_CLOSE_RE.findall(line)))
        if ("(" in line or line.startswith("function")) and _FUNCTION_RE.match(line):
            depth += 1
        elif line == "}" and depth:
            depth -= 1
        if kind is None:
            continue
        if nested:
            if kind == "activation":
                return Unreproducible(f"line {start} ({line[:80]}) sets up the environment inside an if/for/while "
                                      "block or a function, which the estimation cannot replay; move it out, or "
                                      "estimate with gpu-estimate --annotate")
            notes.append(f"line {start} inside a block: not replayed")
            continue
        if shell not in _SHELLS:
            return Unreproducible(f"line {start} ({line[:80]}) would be replayed with bash, but the batch script "
                                  f"runs under {shell[:20]}; estimate with gpu-estimate --annotate")
        if len(line) > MAX_LINE_BYTES:
            return Unreproducible(f"line {start} is longer than {MAX_LINE_BYTES} bytes")
        if len(lines) == MAX_LINES:
            return Unreproducible(f"line {start}: more than {MAX_LINES} environment lines")
        lines.append(EnvironmentLine(start, line))
    return Environment(tuple(lines), login, tuple(notes))


def shell_word(word: str) -> str:
    """``word`` for the replay's shell: variables (``$VENV/bin/python``) expand as in the batch script, and
    anything else the shell would act on is quoted."""
    if _SIMPLE_WORD_RE.match(word) and "$(" not in word:
        return f'"{word}"'
    return shlex.quote(word)


def replay_script(environment: Environment) -> list[str]:
    """Shell lines (bash) that replay ``environment`` as the user, writing into ``$gpushare_out``: each line,
    its failure appended to ``env_failed``; a line that ends the shell (``exit``, or a failure under ``set -e``)
    leaves its number in ``env_line`` and exit status 91."""
    body = ['gpushare_line=0',
            'trap \'if [ "$gpushare_line" != 0 ]; then echo "$gpushare_line" > "$gpushare_out/env_line"; '
            'echo 91 > "$gpushare_out/exit"; exit 91; fi\' EXIT']
    if any(_first_word(line.text) in ("module", "ml") for line in environment.lines):
        # Lmod / Environment Modules define `module` in login shells; a job's non-login shell may lack it.
        body.append("type module >/dev/null 2>&1 || for f in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh "
                    "/usr/share/lmod/lmod/init/bash; do [ -r \"$f\" ] && . \"$f\" && break; done")
    for line in environment.lines:
        body += [f"gpushare_line={line.number}", line.text,
                 f'[ $? = 0 ] || echo {line.number} >> "$gpushare_out/env_failed"']
    body.append("gpushare_line=0")
    return body
