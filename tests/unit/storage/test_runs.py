"""The run root's control records (storage/runs.py) as their readers meet them."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading

import pytest

from tunix_tasks.actor.remote.engine import run_weights_folder
from tunix_tasks.config import ConfigError, config_from_dict
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.runs import (
    MAX_DONE_BYTES,
    RunFence,
    RunReplaced,
    is_done,
    join_run,
    mark_done,
    replaced_since,
    run_id,
    write_config,
)
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


def _delete_run(store) -> None:
    """The run's objects deleted, as `gsutil rm -r` (or `rm -r` of its folder) does."""
    for info in store.list(""):
        store.delete(info.key)


def _fenced(uri: str):
    stops: list[str] = []
    store = open_store(uri)
    return RunFence(store, run_id(store), on_replaced=stops.append), stops


def test_a_fence_writes_while_the_run_is_the_one_it_joined_and_never_after(store_uri):
    """A deleted run's leftover actor writes through its fence: nothing reaches the run
    created again there, each write path alike, and the actor is asked to stop once."""
    root, _, name = store_uri.rstrip("/").rpartition("/")
    cfg = config_from_dict({"store": root, "run_name": name})
    write_config(cfg)
    fence, stops = _fenced(cfg.run_uri)
    fence.write_bytes("shards/a.parquet", b"1")
    assert fence.write_if_generation("control/x", b"1", 0) > 0
    fence.delete("control/x")
    store = open_store(cfg.run_uri)
    _delete_run(store)
    again = run_id(write_config(cfg))
    for write in (
        lambda: fence.write_bytes("shards/b.parquet", b"2"),
        lambda: fence.write_if_generation("control/y", b"2", 0),
        lambda: fence.delete(RunLayout.CONFIG),
    ):
        with pytest.raises(RunReplaced, match=f"created again \\(run_id {again}\\)"):
            write()
    assert len(stops) == 1 and again in stops[0]
    assert sorted(i.key for i in store.list("")) == [RunLayout.CONFIG, RunLayout.RUN_ID]
    assert fence.read_bytes(RunLayout.RUN_ID) == again.encode()  # reads pass through


class _ReplacedMidWrite:
    """A store whose run is deleted and created again between a fence's check and the
    write it lets through (two requests: another process may come between them)."""

    def __init__(self, cfg) -> None:
        self.cfg, self.store = cfg, open_store(cfg.run_uri)

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def _replace(self) -> None:
        _delete_run(self.store)
        write_config(self.cfg)

    def write_bytes(self, key, data) -> None:
        self._replace()
        self.store.write_bytes(key, data)

    def write_if_generation(self, key, data, generation) -> int:
        self._replace()
        return self.store.write_if_generation(key, data, generation)


@pytest.mark.parametrize("how", ["write_bytes", "write_if_generation"])
def test_a_write_let_through_as_the_run_is_replaced_is_taken_back(tmp_path, how):
    """The check before a write cannot stop a write racing the replacement: the fence
    looks again after it, and takes back what it wrote into the run created again."""
    cfg = config_from_dict({"store": str(tmp_path), "run_name": "r"})
    first = run_id(write_config(cfg))
    stops: list[str] = []
    fence = RunFence(_ReplacedMidWrite(cfg), first, on_replaced=stops.append)
    write = {
        "write_bytes": lambda: fence.write_bytes("shards/a.parquet", b"shard"),
        "write_if_generation": lambda: fence.write_if_generation("control/x", b"1", 0),
    }[how]
    with pytest.raises(RunReplaced, match="created again"):
        write()
    store = open_store(cfg.run_uri)
    assert run_id(store) != first and len(stops) == 1
    assert sorted(i.key for i in store.list("")) == [RunLayout.CONFIG, RunLayout.RUN_ID]


def test_a_fence_takes_back_only_keys_no_other_run_writes(tmp_path):
    """A snapshot file is named by its version, which the run created again also
    publishes (v0 from the same seed: the same bytes): a write of it that landed there is
    left, never deleted as if it were the leftover's; the next write is fenced."""
    cfg = config_from_dict({"store": str(tmp_path), "run_name": "r"})
    fence = RunFence(_ReplacedMidWrite(cfg), run_id(write_config(cfg)))
    fence.write_bytes("weights/v00000000/params.safetensors", b"same")
    store = open_store(cfg.run_uri)
    assert store.read_bytes("weights/v00000000/params.safetensors") == b"same"
    with pytest.raises(RunReplaced, match="created again"):
        fence.delete("learner/flow.json")


def test_a_write_cut_off_as_the_run_goes_is_the_fences_stop_other_failures_stay(tmp_path):
    """A local write's temp file renamed away with the run's folder fails the write with
    the OS's error: with the run gone that is `RunReplaced` (a fenced process, exit 3),
    not a storage failure (exit 5: what CI saw); on the same run the error is its own."""
    cfg = config_from_dict({"store": str(tmp_path), "run_name": "r"})
    store = write_config(cfg)

    class CutOff(_ReplacedMidWrite):
        replace = False

        def write_bytes(self, key, data) -> None:
            if self.replace:
                _delete_run(self.store)
            raise FileNotFoundError(2, "No such file or directory", f"{key}.tmp")

    cut = CutOff(cfg)
    fence = RunFence(cut, run_id(store))
    with pytest.raises(FileNotFoundError):
        fence.write_bytes("learner/flow.json", b"{}")
    cut.replace = True
    with pytest.raises(RunReplaced, match="holds no run: deleted"):
        fence.write_bytes("learner/flow.json", b"{}")


def test_a_fence_stops_writes_into_a_deleted_run_but_not_one_missing_only_its_id(tmp_path):
    """`run_id` gone while `config.json` is there (a delete cut short) is still the run;
    both gone is a deleted run, whose folder a write would create again."""
    cfg = config_from_dict({"store": str(tmp_path), "run_name": "r"})
    store = write_config(cfg)
    fence, stops = _fenced(cfg.run_uri)
    store.delete(RunLayout.RUN_ID)
    fence.write_bytes("metrics/a.jsonl", b"{}\n")
    assert stops == []
    _delete_run(store)
    with pytest.raises(RunReplaced, match="holds no run: deleted"):
        fence.write_bytes("metrics/b.jsonl", b"{}\n")
    assert stops and store.list("") == []


def test_a_fence_of_a_run_from_before_ids_stops_once_an_id_appears(tmp_path):
    store = open_store(f"file://{tmp_path}/run")
    store.write_bytes(RunLayout.CONFIG, b"{}")
    fence, stops = _fenced(store.uri)
    assert fence.joined == ""
    fence.write_bytes("a", b"1")  # still the run from before ids
    store.write_if_generation(RunLayout.RUN_ID, b"0" * 32, 0)  # only a new run gets one
    with pytest.raises(RunReplaced, match="after this process joined a run from before run"):
        fence.write_bytes("b", b"1")
    assert len(stops) == 1
    store.delete(RunLayout.RUN_ID)
    fence, stops = _fenced(store.uri)
    store.delete(RunLayout.CONFIG)  # deleted, and not created again
    with pytest.raises(RunReplaced, match="holds no run: deleted"):
        fence.write_bytes("c", b"1")
    assert not store.exists("c")


def test_a_local_run_deleted_as_its_contents_gets_a_new_id(tmp_path):
    """`rm -r runs/NAME/*` leaves the hidden generations of the old id: the run created
    again there must still get its own, or neither the fence nor the learner's
    `other_run` could tell the deleted run's leftover actors from its own."""
    cfg = config_from_dict({"store": str(tmp_path), "run_name": "r"})
    first = run_id(write_config(cfg))
    fence, _ = _fenced(cfg.run_uri)
    for path in (tmp_path / "r").iterdir():
        if path.name.startswith("."):  # the shell's * leaves them
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    assert (tmp_path / "r" / f".{RunLayout.RUN_ID}.gens").is_dir()
    again = run_id(write_config(cfg))
    assert again not in ("", first)
    with pytest.raises(RunReplaced, match=f"created again \\(run_id {again}\\)"):
        fence.write_bytes("shards/a.parquet", b"1")
    assert run_id(write_config(cfg)) == again  # a resume keeps it


def test_a_prepare_between_a_local_ids_two_files_takes_it_for_the_runs(tmp_path, monkeypatch):
    """Locally a new id's generation file lands before its plain file; a concurrent
    prepare that comes between them took the id for one a run deleted as its contents
    left, and wrote its own over it (the plain file then held the loser's)."""
    cfg = config_from_dict({"store": str(tmp_path), "run_name": "r"})
    replace, linked, go = os.replace, threading.Event(), threading.Event()

    def held_first(src, dst) -> None:  # the first prepare's plain id file waits
        if threading.current_thread().name == "first" and str(dst).endswith("/run_id"):
            linked.set()
            go.wait(10)
        replace(src, dst)

    monkeypatch.setattr(os, "replace", held_first)
    first = threading.Thread(target=write_config, args=(cfg,), name="first")
    first.start()
    assert linked.wait(10)
    threading.Timer(0.3, go.set).start()
    store = write_config(cfg)
    first.join(10)
    gens = tmp_path / "r" / f".{RunLayout.RUN_ID}.gens"
    assert len(os.listdir(gens)) == 1
    assert (tmp_path / "r" / RunLayout.RUN_ID).read_text() == run_id(store)


def test_a_fence_hands_out_no_handle_that_writes_around_it(tmp_path):
    fence, _ = _fenced(f"file://{tmp_path}/run")
    assert fence.exists("x") is False
    for name in ("arrow_filesystem", "orbax_path"):
        with pytest.raises(AttributeError, match=f"not '{name}'"):
            getattr(fence, name)


def test_a_corrupt_run_id_mid_run_fences_instead_of_failing_every_write(tmp_path):
    cfg = config_from_dict({"store": str(tmp_path), "run_name": "r"})
    store = write_config(cfg)
    fence, stops = _fenced(cfg.run_uri)
    store.delete(RunLayout.RUN_ID)
    store.write_bytes(RunLayout.RUN_ID, b"garbage")
    with pytest.raises(RunReplaced, match=r"no longer readable: .*not 32 hex digits"):
        fence.write_bytes("a", b"1")
    assert len(stops) == 1


def test_joining_a_run_created_again_since_it_was_prepared_is_refused(tmp_path):
    """What a retried DAG task (or a restarted `train` child) meets: it was started for
    the run as its setup prepared it, and a run created again there is another one."""
    cfg = config_from_dict({"store": str(tmp_path), "run_name": "r"})
    first = run_id(write_config(cfg))
    got, _, joined = join_run(cfg.run_uri, first)
    assert got.run_name == "r" and joined == first
    assert join_run(cfg.run_uri)[2] == first  # no expectation: the run as it is now
    shutil.rmtree(tmp_path / "r")
    again = run_id(write_config(cfg))
    with pytest.raises(RunReplaced, match=f"created again \\(run_id {again}\\).*{first}"):
        join_run(cfg.run_uri, first)
    assert replaced_since(open_store(cfg.run_uri), again) is None
