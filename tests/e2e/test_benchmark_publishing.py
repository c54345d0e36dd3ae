"""benchmarks/publishing.py runs end to end at a small size on both stores: the three
modes interleaved, no compile inside a timed window, every version asked for accounted
for (published or coalesced), and each mode's longest stall of the learner's thread;
on gs:// with the cores split as on an accelerator (`--pin`)."""

from __future__ import annotations

import os

import pytest

from tests.benchmark_scripts import run_benchmark


@pytest.mark.parametrize(("store", "pin"), [("file", False), ("gs", True)])
def test_publishing_benchmark_runs_on_each_store(store, pin):
    if pin and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--pin needs 2 cores")
    # 8 rows: the tests run on 8 host devices, and the batch is split over them
    stdout = run_benchmark(
        "publishing.py",
        *("--preset", "tiny", "--rows", "8", "--steps", "3", "--repeats", "1"),
        *("--store", store, *(["--pin"] if pin else [])),
    )
    assert f"store {store}" in stdout
    lines = stdout.splitlines()
    if pin:  # XLA's threads on the first core; the publisher's alone elsewhere
        first = min(os.sched_getaffinity(0))
        pinned = next(line for line in lines if line.startswith("pinned:"))
        assert f"the step on core {first};" in pinned and f"'{first}': " in pinned, pinned
    header = next(i for i, line in enumerate(lines) if line.startswith("mode "))
    rows = {line.split()[0]: line.split() for line in lines[header + 1 :]}
    rows["in order"] = rows.pop("in")[1:]  # the mode's name is two words
    assert set(rows) == {"off", "coalesce", "in order"}, stdout
    for mode in ("coalesce", "in order"):
        step_ms, _, _, stall_ms, published, coalesced, publish_ms = map(float, rows[mode][1:])
        assert step_ms > 0 and stall_ms > 0 and publish_ms > 0
        assert published + coalesced == 3 and published >= 1
    assert rows["in order"][6] == "0"  # in order: nothing is coalesced
