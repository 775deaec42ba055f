"""Thousands of generated scripts and requests through the service's decision path: never a crash, never
a silent rewrite (every rewrite carries a record and a message, and only gpu:1 becomes shard:N)."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpushare.config import parse_config
from gpushare.slurm_plugins.decision import parse_record
from gpushare.slurm_plugins.protocol import _NO_VAL_LIMIT, ProtocolError, decode_reply, decode_request, encode_reply, encode_request
from gpushare.slurm_plugins.submitd import SubmitServer, handle_submit

CFG = parse_config({"submit": {"cache_dir": "/nonexistent"}, "nodes": [{"names": "n1", "gpu": "a100-80gb"}]})

directive_values = st.one_of(
    st.from_regex(r"-?[0-9]{0,6}(\.[0-9]{1,3})?[kKmMgGtTpPxQ]?(i?[bB])?", fullmatch=True),
    st.text(max_size=30),
)
directive_line = st.builds(
    lambda key, value, case: f"{case}GPUSHARE {key}={value}",
    st.sampled_from(["mem", "est", "estimate", "mode", "script", "bogus", ""]), directive_values,
    st.sampled_from(["#", "# ", "  #", "#\t"]),
)
script_lines = st.lists(st.one_of(directive_line, st.text(max_size=80), st.just("#!/bin/bash")), max_size=20)
gres_strings = st.one_of(
    st.none(), st.sampled_from(["gres:gpu:1", "gres:gpu:2", "gres:shard:4", "gres:gpu:a100:1", "gres:mps:50",
                                "gres:gpu:1,gres:license:1", "gres/gpu:1"]),
    st.text(alphabet="gres:puhardm0123456789,/.-", max_size=30),
)


@settings(max_examples=2500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=script_lines, per_node=gres_strings, per_job=gres_strings, nodes=st.one_of(st.none(), st.integers(0, 2**32)),
       uid=st.integers(-5, 2**32), raw_tail=st.binary(max_size=64))
@pytest.mark.slow
def test_generated_requests_never_crash_or_rewrite_silently(lines, per_node, per_job, nodes, uid, raw_tail):
    script = "\n".join(lines)
    line = encode_request({"op": "submit", "user_id": uid, "tres_per_node": per_node, "tres_per_job": per_job,
                           "min_nodes": nodes, "work_dir": "/tmp",
                           "script": script + raw_tail.decode("latin-1")})
    try:
        _, request, fields = decode_request(line.rstrip(b"\n"))
    except ProtocolError:  # the server answers it as a bad request, and the shim accepts the job unchanged
        assert not 0 <= uid < _NO_VAL_LIMIT
        return
    decision = handle_submit(CFG, request, fields.get("work_dir"))
    assert decision.action in ("accept", "modify", "reject")
    reply = decode_reply(encode_reply(decision))
    if decision.action == "modify":
        record = parse_record(reply["admin_comment"])
        assert record and record["decision"] == "shared" and reply["user_msg"]
        # one shard request, in the GRES separator the request used (gres: on 22.05, gres/ from 24.11)
        assert per_node and "gpu" in per_node and len(re.findall(r"gres[:/]shard:", reply["tres_per_node"])) == 1
    if decision.action == "reject":
        assert CFG.submit.on_bad_directive == "reject"


@settings(max_examples=1500, deadline=None)
@given(garbage=st.binary(max_size=300))
def test_garbage_requests_fail_open(garbage):
    server = SubmitServer.__new__(SubmitServer)  # decision path only; no socket needed
    server.cfg = CFG
    decision, _ = server.decide_line(garbage)
    assert decision.action == "accept" and not decision.tres_per_node


def test_protocol_round_trip_keeps_non_utf8_bytes_safe():
    script = "#!/bin/sh\n#GPUSHARE mem=3G\n".encode() + bytes(range(128, 256)) + "é".encode()
    line = encode_request({"op": "submit", "tres_per_node": "gres:gpu:1",
                           "script": script.decode("utf-8", "surrogateescape")})
    _, request, _ = decode_request(line.rstrip(b"\n"))
    assert request.script.startswith("#!/bin/sh\n#GPUSHARE mem=3G\n") and request.script.endswith("é")


def test_a_user_id_that_is_no_uid_is_a_protocol_error_not_an_unknown_user():
    for bad in (b'{"user_id": "root"}', b'{"user_id": -5}', b'{"user_id": true}', b'{"user_id": 4294967294}'):
        with pytest.raises(ProtocolError, match="not a uid"):
            decode_request(bad)
    assert decode_request(b'{"user_id": 1001}')[1].user_id == 1001
    assert decode_request(b'{}')[1].user_id == -1  # absent: unknown, and then no user file is read


def test_decode_rejects_non_objects():
    for bad in (b"[1,2]", b"{", "é".encode()):
        try:
            decode_request(bad)
        except ProtocolError:
            continue
        raise AssertionError(bad)


def test_huge_script_scan_is_bounded():
    script = "#!/bin/sh\n" + ("# filler line\n" * 500_000) + "#GPUSHARE mem=3G\n"
    line = encode_request({"op": "submit", "tres_per_node": "gres:gpu:1", "script": script})
    _, request, fields = decode_request(line.rstrip(b"\n"))
    decision = handle_submit(CFG, request, None)
    assert decision.action == "accept"  # the directive lies past max_script_bytes: no estimate
