"""Which training script (and arguments) a batch script runs: what the asynchronous estimation estimates.

Pure text analysis, no I/O: the estimation job later runs ``gpu-estimate SCRIPT ARGS`` as the user in the
job's working directory. Why explicit rules instead of running the batch script: the batch script may do
anything (copy data, start servers); only the Python command of the training is safe and cheap to replay.

Recognised (after optional ``VAR=value`` prefixes, ``exec``, ``time``, ``nohup``, ``srun [options]``):

- ``python [-u -O -B -W x -X x] train.py args``, ``python3.11 …``, ``/path/to/venv/bin/python …``;
- ``python -m package.module args`` (how ``module``): gpu-estimate runs it as ``python -m`` does;
- ``python -m torch.distributed.run|torch.distributed.launch [options] train.py args``;
- ``torchrun [options] train.py args``, ``accelerate launch [options] train.py args``, ``deepspeed [options]
  train.py args``, ``lightning run model`` / ``fabric run [model] [options] train.py args``; each also with
  ``-m``/``--module`` (a module instead of a file);
- ``./train.py args`` (any path ending in ``.py`` run as a command): its ``#!`` line names the interpreter;
- a ``#GPUSHARE script=train.py`` directive: that file, with the arguments of the line that runs it if any;
- when no line above is found: the last command of the script that is not a shell builtin or a common
  utility (``litgpt finetune_lora …``, ``tune run …``, ``yolo train …``: a package's console script), how
  ``command``. Whether it is a Python program is for gpu-estimate to find out, in the job's environment (it
  refuses anything else); this text analysis cannot tell.

When several lines qualify, the last one wins (preparation usually comes first) and the choice is
reported. Arguments may use variables assigned earlier in the script with plain ``NAME=value`` lines;
anything else (``$SLURM_ARRAY_TASK_ID``) is reported as unresolved and left as written.

Known limitations: ``python -c``, containers (``apptainer exec``), ``conda run``, ``mpirun`` and commands
built in shell functions are not followed; the result then says why and names the ``#GPUSHARE script=``
directive as the fix.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, replace

from gpushare.estimate.environment_replay import Environment, joined_lines

_PYTHON_RE = re.compile(r"^(?:.*/)?python(?:\d+(?:\.\d+)?)?$")
_ASSIGN_RE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(\S*)\s*$")
_VAR_RE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_OPERATORS = {";", "&&", "||", "|", "&", ">", ">>", "<", "<<", ">&", "&>", "2>", "2>>", "(", ")", "|&"}
_CANDIDATE_RE = re.compile(r"python|torchrun|accelerate|deepspeed|lightning|fabric|\.py\b")  # launchers named
_PREFIX_WORDS = {"exec", "time", "nohup", "command", "stdbuf"}
_DISTRIBUTED_MODULES = {"torch.distributed.run", "torch.distributed.launch"}
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*$")
_COMMAND_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.+-]*$")  # a plain command name: no path, no variable
# First words that are not training: shell keywords and builtins, environment set-up, file and network tools,
# Slurm's own commands, containers and MPI (not followed), and interpreters of other languages.
_NOT_TRAINING = frozenset("""
    if then else elif fi for while until do done case esac function select in time coproc { } [ [[ ! : true false
    cd pushd popd echo printf export unset set shopt source . eval exit return trap wait sleep read shift ulimit
    umask alias unalias local declare typeset readonly let test hash type command builtin enable getopts jobs
    kill disown logout exec
    module ml conda mamba micromamba activate deactivate pip pip3 uv pipx spack virtualenv
    nvidia-smi nvcc mkdir rmdir cp mv rm ln ls cat tee touch chmod chown tar unzip zip gzip gunzip xz wget curl
    git rsync scp ssh find xargs grep sed awk head tail sort uniq wc cut tr date hostname whoami id env which
    printenv df du free top ps pkill seq basename dirname realpath readlink mktemp stat nproc lscpu
    sbatch scontrol squeue scancel sacct sinfo salloc sattach sstat srun mpirun mpiexec orterun
    apptainer singularity docker podman enroot charliecloud shifter
    bash sh zsh dash ksh csh tcsh perl ruby node java Rscript R julia make cmake
    huggingface-cli hf wandb mlflow tensorboard ray jupyter
""".split())

# Bounds on what a batch script can make this (privileged, per-request) code build. Why: ``A=<30 KB>``
# then ``python t.py $A$A…`` once expanded to ~0.5 GB in one request. A real training command is a few
# hundred bytes; anything past these limits is refused before it is built.
MAX_WORD_BYTES = 4096  # one expanded argument
MAX_COMMAND_BYTES = 8192  # the script path plus all its expanded arguments
MAX_WORDS = 512  # arguments of one command
MAX_CANDIDATES = 32  # launcher lines tokenised (the last ones: the last wins); earlier ones only counted


class _TooLong(ValueError):
    """An expansion went past MAX_WORD_BYTES / MAX_COMMAND_BYTES (detected before it is built)."""

# Options that take no value, per launcher; any other option without "=" consumes the next word.
_PYTHON_VALUE_OPTS = {"-W", "-X", "--check-hash-based-pycs"}
_SRUN_FLAGS = {"-l", "--label", "-u", "--unbuffered", "--exclusive", "-K", "--kill-on-bad-exit", "-v",
               "--verbose", "-Q", "--quiet", "--overlap", "--pty", "-X", "--disable-status", "-Z", "--no-allocate",
               "--multi-prog", "--overcommit", "-O", "--exact", "--whole", "-s", "--oversubscribe"}
_TORCHRUN_FLAGS = {"--standalone", "--no_python", "--no-python", "--run_path", "--run-path", "-m", "--module",
                   "--use_env", "--use-env"}
_DEEPSPEED_FLAGS = {"--module", "--no_python", "--no_local_rank", "--no_ssh", "--no_ssh_check", "--force_multi",
                    "--save_pid", "--autotuning", "--bind_cores_to_rank", "-q", "--quiet"}
_MODULE_FLAGS = {"-m", "--module"}  # the launcher runs a module, not a file
_ACCELERATE_FLAGS = {"--cpu", "--multi_gpu", "--tpu", "--use_deepspeed", "--use_fsdp", "--use_megatron_lm",
                     "--use_xpu", "-m", "--module", "--no_python", "--debug", "-q", "--quiet", "--same_network",
                     "--enable_cpu_affinity"}


@dataclass(frozen=True)
class TrainingCommand:
    """The training script to estimate and how it was found (``how`` and ``line`` go into the record)."""

    script: str
    args: tuple[str, ...] = ()
    how: str = "python"  # python | module | torchrun | accelerate | deepspeed | fabric | shebang | command | directive
    line: int = 0
    notes: tuple[str, ...] = ()
    # The launcher word as written (python3, $VENV/bin/python, torchrun): the interpreter the training would
    # use, resolved in the replayed environment (gpushare/estimate/environment_replay.py); "" for a directive
    # whose script no line runs.
    interpreter: str = field(default="", compare=False)
    # A multi-process launcher's words before the script (torchrun --nproc_per_node=8, srun -n 4 python,
    # accelerate launch --num_processes 4), variables expanded: gpu-estimate reads the world size from them
    # and estimates one rank of that world; () for a single-process line.
    launcher: tuple[str, ...] = field(default=(), compare=False)
    environment: Environment | None = field(default=None, compare=False)  # lines to replay before it


@dataclass(frozen=True)
class NotFound:
    """Why no training script could be found; ``reason`` is shown to the user as is."""

    reason: str


@dataclass
class _Line:
    number: int
    text: str
    words: list[str] = field(default_factory=list)


def find_training_command(batch_script: str, directive_script: str | None = None,
                          max_bytes: int = 65536) -> TrainingCommand | NotFound:
    """Find the training command in a batch script (see the module docstring for the rules)."""
    variables: dict[str, str] = {}
    candidates: list[TrainingCommand] = []
    skipped: list[str] = []
    lines = _logical_lines(batch_script[:max_bytes])
    launchers = [index for index, line in enumerate(lines) if _CANDIDATE_RE.search(line.text)]
    examined = set(launchers[-MAX_CANDIDATES:])  # tokenising is the costly part: bounded per request
    if len(launchers) > MAX_CANDIDATES:
        skipped.append(f"{len(launchers)} launcher-like lines; only the last {MAX_CANDIDATES} examined")
    for index, line in enumerate(lines):
        assign = _ASSIGN_RE.match(line.text)
        if assign:
            variables[assign.group(1)] = assign.group(2).strip("'\"")
            continue
        if index not in examined:
            continue  # cheap: most lines of a batch script are never tokenised
        if len(line.text) > 2 * MAX_COMMAND_BYTES:  # no command that long is usable: skip, never tokenise
            skipped.append(f"line {line.number}: longer than {2 * MAX_COMMAND_BYTES} bytes")
            continue
        try:
            line.words = _split(line.text)
        except ValueError:
            continue
        found = _parse_command(line, variables)
        if isinstance(found, TrainingCommand):
            found = replace(found, interpreter=_launcher_word(line.words))
            candidates.append(found)
        elif found is not None:
            skipped.append(f"line {line.number}: {found.reason}")
    if directive_script:
        return _from_directive(directive_script, candidates)
    if not candidates and not directive_script:  # a package's console script (litgpt, tune, yolo)?
        command = _last_command(batch_script[:max_bytes], variables)
        if command is not None:
            return command
    if not candidates:
        detail = f" ({skipped[-1]})" if skipped else ""
        return NotFound("no 'python train.py', torchrun or accelerate launch line found in the batch script"
                        f"{detail}; add '#GPUSHARE script=train.py' or run gpu-estimate --annotate")
    chosen = candidates[-1]
    if len(candidates) > 1:
        others = ", ".join(str(c.line) for c in candidates[:-1])
        chosen = _with_note(chosen, f"several Python commands (lines {others}, {chosen.line}); used the last")
    return chosen


def _launcher_word(words: list[str]) -> str:
    """The word that starts the training (python, torchrun, accelerate), after prefixes and srun's options."""
    words = list(words)
    while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]) or words[0] in _PREFIX_WORDS):
        words.pop(0)
    if words and words[0] == "srun":
        words = _skip_options(words[1:], _SRUN_FLAGS)
    return words[0] if words else ""


def _from_directive(path: str, candidates: list[TrainingCommand]) -> TrainingCommand:
    for candidate in reversed(candidates):
        if candidate.script == path or candidate.script.rsplit("/", 1)[-1] == path.rsplit("/", 1)[-1]:
            return TrainingCommand(path, candidate.args, "directive", candidate.line, candidate.notes,
                                   candidate.interpreter)
    return TrainingCommand(path, (), "directive", 0, ("no line runs it; estimated without arguments",))


def _with_note(command: TrainingCommand, note: str) -> TrainingCommand:
    return replace(command, notes=(*command.notes, note))


_RELEVANT_LINE_RE = re.compile(r"^[^\n]*(?:=|python|torchrun|accelerate|\.py\b)[^\n]*$", re.MULTILINE)


def _logical_lines(text: str) -> list[_Line]:
    """Join backslash continuations; drop comments, blank lines and here-doc bodies are kept as is.

    Without continuations only lines that can matter (an assignment or a launcher) are built, found by
    one regular-expression scan: 64 KiB of short junk lines then costs a few milliseconds."""
    if "\\\n" not in text and "\\\r" not in text:
        lines, number, position = [], 1, 0
        for match in _RELEVANT_LINE_RE.finditer(text):
            number += text.count("\n", position, match.start())
            position = match.start()
            stripped = match.group(0).strip()
            if stripped and not stripped.startswith("#"):
                lines.append(_Line(number, stripped))
        return lines
    return [_Line(start, line) for start, line in joined_lines(text)]


def _split(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words = list(lexer)
    for index, word in enumerate(words):  # a command ends at the first shell operator
        if word in _OPERATORS or set(word) <= set(";&|<>()"):
            head = words[:index]
            if head and head[-1].isdigit() and word.startswith((">", "<")):
                head = head[:-1]  # "2>" arrives as "2", ">"
            return head
    return words


def _parse_command(line: _Line, variables: dict[str, str]) -> TrainingCommand | NotFound | None:
    words = list(line.words)
    while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]) or words[0] in _PREFIX_WORDS):
        words.pop(0)
    found = _parse_words(line, words, variables)
    if isinstance(found, TrainingCommand) and words and (
            words[0] == "srun" or found.how in ("torchrun", "accelerate", "deepspeed", "fabric", "module")):
        head = words[:len(words) - 1 - len(found.args)]
        budget = [MAX_COMMAND_BYTES]
        try:
            launcher = tuple(_expand(word, variables, budget)[0] for word in head)
        except _TooLong:
            launcher = ()
        if launcher and not any("$" in word for word in launcher):
            found = replace(found, launcher=launcher)
    return found


def _parse_words(line: _Line, words: list[str], variables: dict[str, str]) -> TrainingCommand | NotFound | None:
    if words and words[0] == "srun":
        words = _skip_options(words[1:], _SRUN_FLAGS)
    if not words:
        return None
    head = words[0].rsplit("/", 1)[-1]
    if _PYTHON_RE.match(words[0]):
        return _python(line, words[1:], variables)
    if head == "torchrun":
        return _launched(line, words[1:], _TORCHRUN_FLAGS, "torchrun", variables)
    if head == "accelerate" and len(words) > 1 and words[1] == "launch":
        return _launched(line, words[2:], _ACCELERATE_FLAGS, "accelerate", variables)
    if head == "deepspeed":
        return _launched(line, words[1:], _DEEPSPEED_FLAGS, "deepspeed", variables)
    if head in ("lightning", "fabric") and words[1:2] == ["run"]:
        rest = words[2:]
        if rest[:1] == ["model"]:
            rest = rest[1:]
        elif head == "lightning":
            return None
        return _launched(line, rest, set(), "fabric", variables)
    if head.endswith(".py") and "$" not in words[0]:  # ./train.py: run by the interpreter its #! line names
        return _script_after(line, words, "shebang", variables)
    return None


def _python(line: _Line, words: list[str], variables: dict[str, str]) -> TrainingCommand | NotFound | None:
    index = 0
    while index < len(words) and words[index].startswith("-"):
        option = words[index]
        if option == "-m":
            module = words[index + 1] if index + 1 < len(words) else ""
            if module in _DISTRIBUTED_MODULES:
                return _launched(line, words[index + 2:], _TORCHRUN_FLAGS, "torchrun", variables)
            if module == "accelerate.commands.launch":
                return _launched(line, words[index + 2:], _ACCELERATE_FLAGS, "accelerate", variables)
            return _script_after(line, words[index + 1:], "module", variables, module=True)
        if option == "-c":
            return None  # one-liners (version checks, downloads) are not training
        index += 2 if option in _PYTHON_VALUE_OPTS else 1
    return _script_after(line, words[index:], "python", variables)


def _skip_options(words: list[str], flags: set[str]) -> list[str]:
    index = 0
    while index < len(words) and words[index].startswith("-") and words[index] != "--":
        word = words[index]
        if "=" in word or word in flags or (len(word) > 2 and word[1] != "-"):
            index += 1  # --opt=value, a flag, or a short option with its value attached (-n4)
        else:
            index += 2
    if index < len(words) and words[index] == "--":
        index += 1
    return words[index:]


def _launched(line: _Line, words: list[str], flags: set[str], how: str,
              variables: dict[str, str]) -> TrainingCommand | NotFound:
    """The script (or, after ``-m``/``--module``, the module) a launcher starts, after its options."""
    rest = _skip_options(words, flags)
    module = any(word in _MODULE_FLAGS for word in words[:len(words) - len(rest)])
    return _script_after(line, rest, how, variables, module=module)


def _last_command(text: str, variables: dict[str, str]) -> TrainingCommand | None:
    """The last plain command of the batch script that is not a builtin or a common utility (_NOT_TRAINING):
    a package's console script, for gpu-estimate to resolve in the job's environment. Only the last
    MAX_CANDIDATES command lines are tokenised."""
    lines = [line for line in _all_lines(text) if not _ASSIGN_RE.match(line.text)][-MAX_CANDIDATES:]
    for line in reversed(lines):
        if len(line.text) > 2 * MAX_COMMAND_BYTES:
            continue
        try:
            words = _split(line.text)
        except ValueError:
            continue
        while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]) or words[0] in _PREFIX_WORDS):
            words.pop(0)
        if not words or words[0] in _NOT_TRAINING or not _COMMAND_RE.match(words[0]) or _CANDIDATE_RE.search(words[0]):
            continue  # the launchers and Python lines are the main rules' (python -c, ./run.sh: not training)
        found = _script_after(line, words, "command", variables, command=True)
        if isinstance(found, TrainingCommand):
            return replace(found, interpreter=words[0])
    return None


def _all_lines(text: str) -> list[_Line]:
    """Every logical line but comments and blank ones (continuations joined)."""
    if "\\\n" in text or "\\\r" in text:
        return [_Line(start, line) for start, line in joined_lines(text) if line.strip()
                and not line.strip().startswith("#")]
    return [_Line(number, line.strip()) for number, line in enumerate(text.splitlines(), 1)
            if line.strip() and not line.strip().startswith("#")]


def _script_after(line: _Line, words: list[str], how: str, variables: dict[str, str], module: bool = False,
                  command: bool = False) -> TrainingCommand | NotFound:
    if not words:
        return NotFound(f"{how} without a script")
    if len(words) > MAX_WORDS:
        return NotFound(f"{how} line has more than {MAX_WORDS} arguments")
    budget = [MAX_COMMAND_BYTES]
    try:
        script, notes = _expand(words[0], variables, budget)
        args = []
        all_notes = list(notes)
        for word in words[1:]:
            value, word_notes = _expand(word, variables, budget)
            args.append(value)
            all_notes.extend(word_notes)
    except _TooLong as exc:
        return NotFound(f"the command on line {line.number} {exc}")
    if "$" in script:
        return NotFound(f"script path {words[0][:60]!r} uses an unknown variable")
    if module and not _MODULE_RE.match(script):
        return NotFound(f"{script[:60]!r} is not a module name")
    if not module and not command and not script.endswith(".py"):
        return NotFound(f"{script[:60]!r} is not a .py file")
    return TrainingCommand(script, tuple(args), how, line.number, tuple(dict.fromkeys(all_notes)))


def _expand(word: str, variables: dict[str, str], budget: list[int]) -> tuple[str, list[str]]:
    """``word`` with known variables substituted; raises _TooLong *before* building a word longer than
    MAX_WORD_BYTES or going past what is left of the command's ``budget`` (a one-item list, shared)."""
    notes: list[str] = []
    parts: list[str] = []
    size = 0
    position = 0
    for match in _VAR_RE.finditer(word):
        name = match.group(1) or match.group(2)
        if name in variables:
            value = variables[name]
        else:
            notes.append(f"${name} left unresolved")
            value = match.group(0)
        for piece in (word[position:match.start()], value):
            size += len(piece)
            if size > MAX_WORD_BYTES:
                raise _TooLong(f"expands a word past {MAX_WORD_BYTES} bytes")
            if size > budget[0]:
                raise _TooLong(f"expands past {MAX_COMMAND_BYTES} bytes")
            parts.append(piece)
        position = match.end()
    tail = word[position:]
    size += len(tail)
    if size > MAX_WORD_BYTES:
        raise _TooLong(f"expands a word past {MAX_WORD_BYTES} bytes")
    if size > budget[0]:
        raise _TooLong(f"expands past {MAX_COMMAND_BYTES} bytes")
    parts.append(tail)
    budget[0] -= size
    return "".join(parts), notes


def describe(command: TrainingCommand) -> str:
    """One line for records and messages: ``train.py --bs 64 (torchrun, line 12)``."""
    text = " ".join([command.script, *command.args])
    where = f"{command.how}, line {command.line}" if command.line else command.how
    return f"{text[:120]} ({where})"
