"""The two texts a MIG node and the controller exchange through the node's own Slurm record.

Why the node record: with ``[mig] coordination = "controller"`` the controller and the GPU node are
different hosts that share no disk, and a configless node has no slurm.conf or gres.conf of its own
(docs/mig.md, "Controller coordination"). Slurm already carries authenticated data between them:
``scontrol update nodename=N extra=…|comment=…`` is an admin-only RPC (munge-authenticated; an ordinary
user gets "Invalid user id"), slurmctld keeps both fields in its saved state across restarts and
``scontrol reconfigure`` (measured on 22.05, 24.11 and 26.05; values of 60,000 characters come back
exactly), and every Slurm host can read them with ``scontrol show node``. Each field has one writer, so no write can undo the
other side's:

- ``Extra``   — written by the controller: the node's **target** layout and the run id that names it.
- ``Comment`` — written by the node: its **report** — the run it last worked on, how far it got, the last
  target it answered, its GPUs' actual layouts (with models) and the gres.conf lines and ``Gres=`` value
  Slurm needs for them.

Format (a contract, docs/mig.md): ``gpushare-mig|v1|key=value|…`` with no spaces (``scontrol show node -o``
separates fields with spaces), ``;`` between GPUs or lines, ``~`` for a space inside a gres.conf line.
Both are parsed strictly: a field holding anything else is not ours and is never overwritten.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpushare.errors import GpushareError
from gpushare.slurm.client import SlurmClient, SlurmError
from gpushare.slurm.nodes import show_node, value

PREFIX = "gpushare-mig|v1"
MAX_CHARS = 16000  # measured: 60,000 characters round-trip exactly on every release; a node needs far less
RUN_RE = re.compile(r"^[a-z0-9]{1,16}$")
_PROFILE = r"[0-9]g\.[0-9]{1,4}gb(?:\+me|\+gfx|-me)?"
_ITEM = rf"{_PROFILE}@[0-7]"
_LAYOUT_RE = re.compile(rf"^(?:empty|{_ITEM}(?:,{_ITEM}){{0,15}})$")
_MODEL_RE = re.compile(r"^[a-z0-9][a-z0-9_.+-]{0,40}$")
_GRES_RE = re.compile(r"^(?:(?:gpu|shard):[A-Za-z0-9_.+-]{1,40}(?::[0-9]{1,6})?|shard:[0-9]{1,6})"
                      r"(?:,(?:(?:gpu|shard):[A-Za-z0-9_.+-]{1,40}(?::[0-9]{1,6})?|shard:[0-9]{1,6})){0,99}$")
# one gres.conf line of a node, without its "NodeName=<node> " prefix: only the keys gres_conf_lines writes
_LINE_RE = re.compile(r"^Name=(?:gpu|shard)(?: Type=[A-Za-z0-9_.+-]{1,40})?(?: Count=[0-9]{1,6})?"
                      r" (?:File|MultipleFiles)=/[A-Za-z0-9_./,\[\]-]{1,400}$")
STATES = ("idle", "files", "done", "already", "rolled_back", "busy", "rate_limited", "nothing",
          "proposed")  # proposed: [policy] mode = observe recorded the reshape and made none


class RecordError(GpushareError, ValueError):
    """A node record field that is not ours or is malformed; the message names node and field."""


@dataclass(frozen=True)
class Target:
    """What the controller wants a node to become: GPU index -> layout text (``empty`` allowed)."""

    run: str
    layouts: dict[int, str]
    written: str = "-"  # the node's last ``files`` token whose files the controller wrote and made Slurm read

    def encode(self) -> str:
        gpus = ";".join(f"{g}:{self.layouts[g]}" for g in sorted(self.layouts))
        return _checked(f"{PREFIX}|run={self.run}|target={gpus}|written={self.written}")


@dataclass(frozen=True)
class Report:
    """What a node says about itself. ``state`` ``files``: it changed its GPUs and waits for the
    controller to write ``lines``/``gres`` and make Slurm read them; any other state is final for ``run``."""

    run: str  # "-" before the first run
    state: str
    gpus: dict[int, tuple[str, str]]  # MIG-mode GPU index -> (catalogue model, layout text)
    gres: str  # the node's Gres= value for its actual GPUs
    lines: tuple[str, ...]  # its gres.conf lines, without "NodeName=<node> "
    files: str = "-"  # with state ``files``: a fresh token the controller echoes in Target.written when done
    answered: str = "-"  # the last controller target (its run id) this node has answered; runs started on the
    # node itself (``apply --target``, a restore after a GPU reset) keep it, so they never re-arm an old target

    def encode(self) -> str:
        gpus = ";".join(f"{g}:{m}:{lay}" for g, (m, lay) in sorted(self.gpus.items()))
        lines = ";".join(line.replace(" ", "~") for line in self.lines)
        return _checked(f"{PREFIX}|run={self.run}|state={self.state}|files={self.files}|answered={self.answered}"
                        f"|gres={self.gres}|gpus={gpus}|lines={lines}")

    def node_lines(self, node: str) -> list[str]:
        return [f"NodeName={node} {line}" for line in self.lines]


def _checked(text: str) -> str:
    if len(text) > MAX_CHARS or " " in text:
        raise RecordError(f"node record text of {len(text)} characters (max {MAX_CHARS}, no spaces)")
    return text


def _fields(text: str, node: str, field: str, keys: tuple[str, ...]) -> dict[str, str] | None:
    """The key=value parts of one of our texts; None when the field is empty; error when it is not ours."""
    if text in ("", "(null)"):
        return None
    where = f"node {node} {field}"
    if len(text) > MAX_CHARS:
        raise RecordError(f"{where}: {len(text)} characters (max {MAX_CHARS})")
    if not text.startswith(PREFIX + "|"):
        raise RecordError(f"{where} holds {text[:40]!r}, not a gpushare-mig record; clear it "
                          f"(scontrol update nodename={node} {field.lower()}=) to let gpushare use it")
    parts = dict(p.partition("=")[::2] for p in text[len(PREFIX) + 1:].split("|"))
    if sorted(parts) != sorted(keys):
        raise RecordError(f"{where}: expected keys {', '.join(keys)}, found {', '.join(sorted(parts))}")
    if parts["run"] != "-" and not RUN_RE.match(parts["run"]):
        raise RecordError(f"{where}: bad run id {parts['run'][:20]!r}")
    return parts


def _token(text: str, where: str) -> str:
    if text != "-" and not RUN_RE.match(text):
        raise RecordError(f"{where}: bad token {text[:20]!r}")
    return text


def _gpu_index(text: str, where: str) -> int:
    if not text.isdigit() or int(text) > 63:
        raise RecordError(f"{where}: bad GPU index {text[:8]!r}")
    return int(text)


def parse_target(text: str, node: str) -> Target | None:
    parts = _fields(text, node, "Extra", ("run", "target", "written"))
    if parts is None:
        return None
    layouts: dict[int, str] = {}
    for item in parts["target"].split(";") if parts["target"] else []:
        index, _, layout = item.partition(":")
        if not _LAYOUT_RE.match(layout):
            raise RecordError(f"node {node} Extra: bad layout {layout[:60]!r}")
        layouts[_gpu_index(index, f"node {node} Extra")] = layout
    return Target(parts["run"], layouts, _token(parts["written"], f"node {node} Extra"))


def parse_report(text: str, node: str) -> Report | None:
    parts = _fields(text, node, "Comment", ("run", "state", "files", "answered", "gres", "gpus", "lines"))
    if parts is None:
        return None
    where = f"node {node} Comment"
    if parts["state"] not in STATES:
        raise RecordError(f"{where}: unknown state {parts['state'][:20]!r}")
    if parts["gres"] and not _GRES_RE.match(parts["gres"]):
        raise RecordError(f"{where}: bad Gres value {parts['gres'][:60]!r}")
    gpus: dict[int, tuple[str, str]] = {}
    for item in parts["gpus"].split(";") if parts["gpus"] else []:
        index, model, layout = (item.split(":") + ["", ""])[:3]
        if not _MODEL_RE.match(model) or not _LAYOUT_RE.match(layout):
            raise RecordError(f"{where}: bad GPU entry {item[:60]!r}")
        gpus[_gpu_index(index, where)] = (model, layout)
    lines = []
    for item in parts["lines"].split(";") if parts["lines"] else []:
        line = item.replace("~", " ")
        if not _LINE_RE.match(line):
            raise RecordError(f"{where}: bad gres.conf line {line[:80]!r}")
        lines.append(line)
    return Report(parts["run"], parts["state"], gpus, parts["gres"], tuple(lines), _token(parts["files"], where),
                  _token(parts["answered"], where))


@dataclass(frozen=True)
class NodeRecord:
    """One node as ``scontrol show node -o`` prints it, reduced to what coordination reads."""

    name: str
    state: str
    gres: str
    comment: str
    extra: str


def read_records(client: SlurmClient, node: str | None = None) -> list[NodeRecord]:
    """Every node's record (one ``scontrol`` call), or one node's."""
    records = [NodeRecord(fields["NodeName"], fields.get("State", ""), value(fields, "Gres"),
                          value(fields, "Comment"), value(fields, "Extra")) for fields in show_node(client, node)]
    if node and not any(r.name == node for r in records):
        raise SlurmError(f"scontrol show node {node}: no such node")
    return records


def write_field(client: SlurmClient, node: str, field: str, text: str) -> None:
    """Set ``Extra`` (controller) or ``Comment`` (node): an admin-only update, authenticated by munge."""
    if field not in ("extra", "comment"):
        raise ValueError(f"not a coordination field: {field}")
    client.run("scontrol", "update", f"nodename={node}", f"{field}={_checked(text)}")
