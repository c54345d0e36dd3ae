"""`make bench` (benchmarks/suite.py) holds one command per row of the README's benchmark
table, with the arguments the row quotes, and runs them as its user would."""

from __future__ import annotations

import re

from tests.benchmark_scripts import run_benchmark
from tests.paths import REPO


def _readme_rows() -> dict[str, str]:
    """The README's benchmark table: script name -> its row."""
    rows = {}
    for line in (REPO / "README.md").read_text().splitlines():
        if m := re.match(r"\| `benchmarks/(\w+)\.py` \|", line):
            rows[m[1]] = line
    return rows


def test_the_suite_runs_every_readme_row_with_the_arguments_it_quotes():
    rows = _readme_rows()
    listed = run_benchmark("suite.py", "--list").splitlines()
    listed += run_benchmark("suite.py", "--list", "--group", "learning").splitlines()
    scripts = {}
    for line in listed:
        _, script, *args = line.split()
        scripts.setdefault(re.fullmatch(r"benchmarks/(\w+)\.py", script)[1], []).append(args)
    assert set(scripts) >= set(rows), "a README row that make bench does not run"
    for name, runs in scripts.items():
        if name in rows:
            quoted = [" ".join(a[: a.index("--out")] if "--out" in a else a) for a in runs]
            assert any(q in rows[name] for q in quoted), (name, quoted)


def test_the_suite_measures_the_machine_and_reports_each_entry(tmp_path):
    stdout = run_benchmark("suite.py", "--only", "model_memory", "--out", str(tmp_path))
    assert re.search(r"matmul \d+ GFLOP/s, DRAM [\d.]+ GB/s", stdout)
    assert "| model_memory |" in stdout and stdout.rstrip().endswith("| 0 |")
    assert "H200" in (tmp_path / "model_memory.log").read_text()
