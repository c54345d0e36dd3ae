"""benchmarks/models.py runs end to end at a toy size (the library APIs it drives still fit)."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import run_benchmark


@pytest.mark.slow  # ~25 s on 2 cores: four fresh subprocesses, compiles for two models
def test_models_benchmark_runs_at_toy_size():
    args = "--families qwen3 llama3 --shard-mb 8 --repeats 1 --fwd-batch 1 --seq 32"
    args += " --sample-batches 2 --new-tokens 2 --json"
    stdout = run_benchmark("models.py", *args.split())
    assert "import peak RSS" in stdout and "reload file" in stdout
    raw = json.loads(stdout[stdout.index("\n{") + 1 :])
    assert raw["machine"]["matmul_flops"] > 0 and raw["machine"]["mem_bw"] > 0
    for r, family in zip(raw["results"], ("qwen3", "llama3"), strict=True):
        assert r["family"] == family
        assert len(r["files"]) > 1  # sharded: index + several files were written and read
        assert r["import_ours"]["load_s"] > 0 and r["import_naive"]["load_s"] > 0
        assert r["forward"]["tokens_per_s"] > 0
        assert [s["batch"] for s in r["sampling"]] == [2]
        assert r["sampling"][0]["tokens_per_s"] > 0
        assert 0 < r["sampling"][0]["limit_tokens_per_s"] < float("inf")
        assert r["reload_file"]["snapshot_bytes"] >= r["model_bytes_fp32"]
        assert r["recompiles_after_reload"] == 0
        assert r["sampling"][0]["compiles_in_measurement"] == 0
