"""The run root's control records (storage/runs.py) as their readers meet them."""

from __future__ import annotations

import json

import pytest

from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.runs import MAX_DONE_BYTES, is_done, mark_done
from tunix_tasks.storage.store import open_store


def test_done_marker_round_trip(tmp_path):
    store = open_store(f"file://{tmp_path}/run")
    assert is_done(store) is None
    mark_done(store, "max_steps reached")
    done = is_done(store)
    assert done["reason"] == "max_steps reached" and done["time"] > 1.7e9


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"", "DONE marker unreadable: Expecting value"),
        (b'{"reason": "x", "ti', "DONE marker unreadable"),
        (b"\x80abc", "DONE marker unreadable: not UTF-8"),
        (b"[" * 20_000 + b"]" * 20_000, "DONE marker unreadable: nested too deeply"),
        (b"{" + b" " * MAX_DONE_BYTES + b"}", f"more than the {MAX_DONE_BYTES} it may"),
        (b"[]", "DONE marker not a JSON object"),
        (b"0", "DONE marker not a JSON object"),
        (b'{"reason": ["a"], "time": 1e400}', "['a']"),
        (b"{}", ""),
    ],
)
def test_any_done_marker_means_done_and_never_a_traceback(tmp_path, body, reason):
    """Its presence is what counts (actors stop on it): before, `{}` read as not done
    (falsy), `[]` crashed the actor's `.get`, and an unbounded body was read whole."""
    store = open_store(f"file://{tmp_path}/run")
    store.write_bytes(RunLayout.DONE, body)
    done = is_done(store)
    assert done and reason in done["reason"]
    assert done["time"] is None
    json.dumps(done)  # the report prints it


@pytest.mark.parametrize("when", [float("nan"), -1.0, 1e20, True, "yesterday"])
def test_a_done_time_no_date_can_show_is_left_out(tmp_path, when):
    store = open_store(f"file://{tmp_path}/run")
    store.write_bytes(RunLayout.DONE, json.dumps({"reason": "r", "time": when}).encode())
    assert is_done(store) == {"reason": "r", "time": None}
