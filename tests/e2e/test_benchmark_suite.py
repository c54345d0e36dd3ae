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


def _listed(*args: str) -> dict[str, list[str]]:
    """`suite.py --list`: script name -> the arguments of each of its runs (less `--out`)."""
    runs: dict[str, list[str]] = {}
    for line in run_benchmark("suite.py", "--list", *args).splitlines():
        _, script, *argv = line.split()
        argv = argv[: argv.index("--out")] if "--out" in argv else argv
        runs.setdefault(re.fullmatch(r"benchmarks/(\w+)\.py", script)[1], []).append(" ".join(argv))
    return runs


def test_the_suite_runs_every_readme_row_with_the_arguments_it_quotes():
    rows = _readme_rows()
    speed, learning = _listed(), _listed("--group", "learning")
    assert set(speed) | set(learning) >= set(rows), "a README row that make bench does not run"
    for name, runs in speed.items():  # each run of a speed row is quoted in the row
        assert all(args in rows.get(name, "") for args in runs), (name, runs)
    for name, runs in learning.items():  # a study's row quotes its main run (docs: the rest)
        assert name not in rows or any(args in rows[name] for args in runs), (name, runs)


def test_the_suite_measures_the_machine_and_reports_each_entry(tmp_path):
    stdout = run_benchmark("suite.py", "--only", "model_memory", "--out", str(tmp_path))
    assert re.search(r"matmul \d+ GFLOP/s, DRAM [\d.]+ GB/s", stdout)
    assert "| model_memory |" in stdout and stdout.rstrip().endswith("| 0 |")
    assert "H200" in (tmp_path / "model_memory.log").read_text()


def test_the_learning_studies_write_their_figures_under_the_suites_out():
    listed = run_benchmark("suite.py", "--list", "--group", "learning", "--out", "elsewhere")
    outs = [line.split("--out ")[1].split()[0] for line in listed.splitlines()]
    assert outs and all(out.startswith("elsewhere/") for out in outs), outs
    assert len(set(outs)) == len(outs), "two studies would write over each other's figures"
