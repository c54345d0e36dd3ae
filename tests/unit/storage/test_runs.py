"""The run root's control records (storage/runs.py) as their readers meet them."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from tunix_tasks.actor.remote.engine import run_weights_folder
from tunix_tasks.config import ConfigError, config_from_dict
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.runs import MAX_DONE_BYTES, is_done, mark_done, run_id, write_config
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


def test_a_run_keeps_its_id_across_resumes_and_a_re_created_run_gets_another(tmp_path):
    """The id tells a run re-created under the same URI from the deleted one whose actors
    may still run: a server they share then serves them as two runs (docs/remote-engine.md)."""
    cfg = config_from_dict({"store": str(tmp_path), "run_name": "r"})
    first = run_id(write_config(cfg))
    assert len(first) == 32 and int(first, 16) >= 0
    assert run_id(write_config(cfg)) == first  # a resume keeps it
    shutil.rmtree(tmp_path / "r")
    again = run_id(write_config(cfg))
    assert again not in ("", first)
    folders = {run_weights_folder("r", cfg.run_uri, i) for i in ("", first, again)}
    assert len(folders) == 3


def test_two_prepares_of_a_new_run_agree_on_its_id(store_uri):
    """Both saw no config.json: the id is created once (compare-and-swap), the second
    prepare keeps the first's, so actors started by either stamp the same id."""
    root, _, name = store_uri.rstrip("/").rpartition("/")
    cfg = config_from_dict({"store": root, "run_name": name})
    first = run_id(write_config(cfg))
    store = open_store(cfg.run_uri)
    store.delete(RunLayout.CONFIG)  # as the second prepare saw it
    assert run_id(write_config(cfg)) == first != ""


def test_a_run_from_before_ids_keeps_its_weights_folder(tmp_path):
    store = open_store(f"file://{tmp_path}/run")
    assert run_id(store) == ""
    tag = hashlib.sha256(b"gs://b/run").hexdigest()[:8]
    assert run_weights_folder("run", "gs://b/run", run_id(store)) == f"run-{tag}"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"not an id", "not 32 hex digits"),
        (b"ABCDEF" * 6, "not 32 hex digits"),
        (b"0" * 31, "not 32 hex digits"),
        (b"\xff" * 32, "not 32 hex digits"),
        (b"0" * 65, "more than the 64 it may"),
        (None, "not a regular file"),
    ],
)
def test_a_poisoned_run_id_is_a_clear_error(tmp_path, body, message):
    store = open_store(f"file://{tmp_path}/run")
    if body is None:  # a FIFO would block a reader forever
        (tmp_path / "run").mkdir()
        os.mkfifo(tmp_path / "run" / RunLayout.RUN_ID)
    else:
        store.write_if_generation(RunLayout.RUN_ID, body, 0)
    with pytest.raises(ConfigError, match=message):
        run_id(store)
