"""The wire format between ``job_submit.lua`` and ``gpushare-submitd``.

Request: one JSON object on one line. Lua 5.1 has no JSON library, so the shim escapes every control,
quote, backslash and non-ASCII byte as ``\\u00XX``; the strings therefore arrive as Latin-1 code points
that map one-to-one to the original bytes, which we turn back into bytes and decode as UTF-8 with
replacement. Non-UTF-8 scripts thus never break the parse.

Reply: ``key=value`` lines ending with ``end``; trivial to parse in Lua, and a reply without ``end`` is
garbage by definition, so the shim fails open. Values never contain newlines.

Our own Python hooks send their requests through gpushare.submitd_client, which needs none of this module.
"""

from __future__ import annotations

import json
from typing import Any

from gpushare.errors import GpushareError
from gpushare.slurm_plugins.decision import Decision, SubmitRequest

MAX_REQUEST_BYTES = 8 << 20
_NO_VAL_LIMIT = 0xFFFFFFF0  # Slurm's NO_VAL family (0xfffffffe, ...) marks unset numbers


class ProtocolError(GpushareError, ValueError):
    pass


def _latin1_to_text(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        return str(value)
    try:
        return value.encode("latin-1").decode("utf-8", errors="replace")
    except UnicodeEncodeError:
        return value  # already real Unicode (a Python client)


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = int(value)
    return None if number < 0 or number >= _NO_VAL_LIMIT else number


def decode_request(line: bytes) -> tuple[str, SubmitRequest, dict[str, Any]]:
    """Parse one request line into (operation, request, raw fields)."""
    if len(line) > MAX_REQUEST_BYTES:
        raise ProtocolError("request too large")
    try:
        raw = json.loads(line.decode("ascii", errors="strict"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"not a JSON request: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError("request is not an object")
    fields = {key: _latin1_to_text(value) if isinstance(value, str) else value for key, value in raw.items()}
    user_id = -1  # unknown: no file of a user is read for it (estimate_source.read_user_file)
    if fields.get("user_id") is not None:
        uid = _int_or_none(fields.get("user_id"))
        if uid is None:
            raise ProtocolError(f"user_id {str(fields.get('user_id'))[:40]!r} is not a uid")
        user_id = uid
    het = _int_or_none(fields.get("het_job_offset"))
    array = fields.get("array_inx")
    request = SubmitRequest(
        user_id=user_id,
        tres_per_node=fields.get("tres_per_node") or None,
        tres_per_job=fields.get("tres_per_job") or None,
        tres_per_task=fields.get("tres_per_task") or None,
        min_nodes=_int_or_none(fields.get("min_nodes")),
        array=bool(array) and array != "0",
        het_offset=het,
        script=fields.get("script") or "",
        partition=str(fields.get("partition") or "")[:1024] or None,
        default_partition=str(fields.get("default_partition") or "")[:256] or None,
        account=str(fields.get("account") or "")[:256] or None,
        qos=str(fields.get("qos") or "")[:256] or None,
    )
    return str(fields.get("op", "submit")), request, fields


def _clean(value: str) -> str:
    return value.replace("\n", " ").replace("\r", " ").replace("\0", "")


def encode_reply(decision: Decision) -> bytes:
    lines = [f"action={decision.action}"]
    if decision.action == "modify" and decision.tres_per_node:
        lines.append(f"tres_per_node={_clean(decision.tres_per_node)}")
    if decision.admin_comment:
        lines.append(f"admin_comment={_clean(decision.admin_comment)}")
    if decision.user_message:
        lines.append(f"user_msg={_clean(decision.user_message)}")
    if decision.reject_message:
        lines.append(f"reject_msg={_clean(decision.reject_message)}")
    if decision.hold:
        lines.append("hold=1")
    lines.append("end")
    return ("\n".join(lines) + "\n").encode("utf-8")


def encode_request(fields: dict[str, Any]) -> bytes:
    """What the Lua shim sends, produced from Python (tests, benchmarks, ``gpushare submit-check``)."""
    out = {}
    for key, value in fields.items():
        if isinstance(value, str):
            value = value.encode("utf-8", "surrogateescape").decode("latin-1")
        out[key] = value
    return (json.dumps(out, ensure_ascii=True) + "\n").encode("ascii")


def decode_reply(data: bytes) -> dict[str, str]:
    lines = data.decode("utf-8", errors="replace").splitlines()
    if not lines or lines[-1] != "end":
        raise ProtocolError("reply without end marker")
    reply = {}
    for line in lines[:-1]:
        key, sep, value = line.partition("=")
        if not sep:
            raise ProtocolError(f"bad reply line {line[:60]!r}")
        reply[key] = value
    return reply
