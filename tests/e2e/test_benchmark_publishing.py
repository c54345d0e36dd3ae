"""benchmarks/publishing.py runs end to end at a small size on both stores: the three
modes interleaved, no compile inside a timed window, every version asked for accounted
for (published or coalesced), and each mode's longest stall of the learner's thread."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import run_benchmark


@pytest.mark.parametrize("store", ["file", "gs"])
def test_publishing_benchmark_runs_on_each_store(store):
    # 8 rows: the tests run on 8 host devices, and the batch is split over them
    stdout = run_benchmark(
        "publishing.py",
        *("--preset", "tiny", "--rows", "8", "--steps", "3", "--repeats", "1"),
        *("--store", store),
    )
    assert f"store {store}" in stdout
    rows = {line.split()[0]: line.split() for line in stdout.splitlines()[2:]}
    rows["in order"] = rows.pop("in")[1:]  # the mode's name is two words
    assert set(rows) == {"off", "coalesce", "in order"}, stdout
    for mode in ("coalesce", "in order"):
        step_ms, _, _, stall_ms, published, coalesced, publish_ms = map(float, rows[mode][1:])
        assert step_ms > 0 and stall_ms > 0 and publish_ms > 0
        assert published + coalesced == 3 and published >= 1
    assert rows["in order"][6] == "0"  # in order: nothing is coalesced
