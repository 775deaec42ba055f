"""The job-field grammars (gpushare/slurm/fields.py) under fuzzing: they never raise and accept ASCII only."""

from __future__ import annotations

import logging
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare.slurm import fields
from gpushare.slurm.admin_comment import merge_fields, merge_write
from gpushare.slurm.gres_request import parse_gres
from gpushare.slurm.jobs import Job
from gpushare.slurm import record

PREFIX = "gpushare-estimate-"
ASCII_NUMBER = re.compile(r"[0-9]{1,12}", re.ASCII)
hostile_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["²", "١٢", "٣", "12 ", " 12", "1\n", "+5", "-1", "1_000", "0x1f", "１２", "1e3", "", "9" * 13])


@settings(max_examples=400, deadline=None)
@given(hostile_text)
def test_numbers_are_ascii_digits_or_none(text):
    value = fields.number(text)
    assert value is None or (ASCII_NUMBER.fullmatch(text) and value == int(text))
    assert fields.job_id(text) == value
    name = fields.suffix_number(PREFIX + text, PREFIX)
    assert name == value and fields.suffix_number(text, PREFIX) in (None, fields.number(text[len(PREFIX):]))


@settings(max_examples=300, deadline=None)
@given(hostile_text)
def test_array_ids_and_partitions_never_raise(text):
    array = fields.array_job_id(text)
    assert array is None or text.startswith(str(array) + "_")
    assert fields.partition(text) in (None, text)
    assert fields.array_job_id("123_[1-5%2]") == 123 and fields.array_job_id("7_4") == 7
    assert fields.array_job_id("7_*") == 7 and fields.array_job_id("٧_4") is None


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["gpu:", "gres:gpu:", "shard:", "gpu:a100:"]), hostile_text)
def test_gres_requests_parse_or_say_what_is_wrong(head, tail):
    try:
        items = parse_gres(head + tail)
    except ValueError as exc:  # one clear refusal, never another exception
        assert "GRES" in str(exc) or "invalid" in str(exc)
        return
    assert all(item.count >= 0 and (item.type is None or item.type.isascii()) for item in items)


def test_skipped_rows_are_counted_and_logged_once(caplog):
    skipped = fields.Skipped(logging.getLogger("test"))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            skipped.skip("12", "estimation job name")
    assert skipped.count == 3 and len(caplog.records) == 1 and "'12'" in caplog.messages[0]


class RacingClient:
    """Slurm's AdminComment as one string; ``racer`` runs after each of our writes, as another writer would."""

    def __init__(self, comment: str, racer) -> None:
        self.comment, self.racer, self.writes = comment, racer, 0

    def job(self, job_id):
        return Job(job_id=str(job_id), states=("RUNNING",), admin_comment=self.comment)

    def update_job(self, job_id, admincomment: str) -> None:
        self.comment, self.writes = admincomment, self.writes + 1
        self.racer(self)


def test_a_write_replaced_right_after_ours_is_merged_again():
    stale = record.render({"decision": "shared"})

    def overwrite_once(client):  # a writer that read before us and writes 1 ms after: our key is gone
        if client.writes == 1:
            client.comment = record.merge(stale, run={"ttfk_s": 1.0})
    client = RacingClient(stale, overwrite_once)
    assert merge_write(client, 5, merge_fields(collateral={"by": 9}), sleep=lambda s: None)
    final = record.parse(client.comment)
    assert final["collateral"] == {"by": 9} and final["run"] == {"ttfk_s": 1.0} and final["decision"] == "shared"
    assert merge_write(RacingClient("site note", lambda c: None), 5, merge_fields(a=1)) is False  # not ours
