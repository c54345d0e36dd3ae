"""Every Python snippet in README.md and docs/*.md runs as written.

Each ```python block is executed, in its own namespace, in a temporary folder that holds
a small real run under `runs/demo` (shards written by `ShardWriter`, metrics records by
`MetricsWriter`), with examples/plugin_env importable as if installed (the plug-in
environment's own install is tested in tests/e2e/test_plugin_env.py). A block fenced
```python no-run is shown only (it needs credentials or a service): it is skipped here,
except the GCS block, which is run against the fake-gcs-server. Shell blocks are not run.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.paths import REPO
from tunix_tasks.storage.metrics import MetricsWriter
from tunix_tasks.storage.shards import ShardWriter
from tunix_tasks.storage.store import open_store
from tunix_tasks.testing.shard_factory import make_episode

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"^( *)```python([^\n]*)\n(.*?)^\1```", re.M | re.S)


def _blocks() -> list[tuple[str, str, str]]:
    """(id "file:line", fence options, code) of every ```python block."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            indent = len(m.group(1))
            code = "\n".join(s[indent:] for s in m.group(3).splitlines())
            out.append((f"{path.relative_to(REPO)}:{line}", m.group(2).strip(), code))
    return out


BLOCKS = _blocks()
RUNNABLE = [(name, code) for name, opts, code in BLOCKS if "no-run" not in opts.split()]


def _write_run(root: Path) -> None:
    """runs/demo: two actors' shards and learner/actor metrics, as a short run leaves."""
    store = open_store(str(root / "runs" / "demo"))
    rng = np.random.default_rng(0)
    for actor in ("actor-0000", "actor-0001"):
        writer = ShardWriter(store, actor_id=actor, max_episodes=8)
        for i in range(16):
            writer.add(make_episode(rng, length=int(rng.integers(8, 40)), actor_id=actor))
            if i == 7:
                writer.close()
        writer.close()
    metrics = MetricsWriter(store, "learner", flush_interval_s=0)
    metrics.log(warm_start_step=1, nll=2.5, step_s=0.01)  # as a warm start logs: no `step`
    for step in range(1, 4):
        metrics.log(step=step, loss=0.5 / step, reward_mean=0.2 * step)
    metrics.close()


@pytest.fixture
def in_demo_run(tmp_path, monkeypatch):
    _write_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO / "examples" / "plugin_env"))
    yield tmp_path
    sys.modules.pop("reverse_env", None)  # the next snippet imports it afresh


def test_the_docs_have_snippets():
    names = {name.split(":")[0] for name, _ in RUNNABLE}
    assert {"README.md", "docs/environments.md"} <= names, names
    assert all(re.fullmatch(r"[\w-]*( no-run)?", opts) for _, opts, _ in BLOCKS), [
        (n, o) for n, o, _ in BLOCKS
    ]


@pytest.mark.parametrize(("name", "code"), RUNNABLE, ids=[n for n, _ in RUNNABLE])
def test_snippet_runs(name, code, in_demo_run):
    exec(compile(code, name, "exec"), {"__name__": "__doc_snippet__"})


def test_environment_docs_show_the_example_source():
    """docs/environments.md quotes examples/plugin_env verbatim (the file is what runs)."""
    text = (REPO / "docs" / "environments.md").read_text()
    for rel in ("reverse_env.py", "pyproject.toml", "reverse.yaml"):
        source = (REPO / "examples" / "plugin_env" / rel).read_text()
        assert source in text, f"docs/environments.md does not show examples/plugin_env/{rel}"


@pytest.mark.gcs
def test_gcs_snippet_reads_the_emulator(gcs_server, tmp_path):
    """The README's GCS block, with the emulator lines it mentions, against fake-gcs-server."""
    [(name, code)] = [(n, c) for n, o, c in BLOCKS if "GcsFileSystem" in c]
    uri = gcs_server.new_bucket_uri("prefix")
    store = open_store(uri + "/demo")
    writer = ShardWriter(store, actor_id="actor-0000", max_episodes=4)
    rng = np.random.default_rng(1)
    for _ in range(4):
        writer.add(make_episode(rng, length=12))
    writer.close()
    host = gcs_server.url.split("://", 1)[1]
    emulator = re.search(r"^# (gcs = pyarrow\.fs\.GcsFileSystem\(anonymous=True.*)$", code, re.M)
    assert emulator, f"{name}: no emulator line"
    code = re.sub(
        r"^gcs = .*$", emulator.group(1).replace("localhost:4443", host), code, count=1, flags=re.M
    )
    code = code.replace("my-bucket/prefix", uri.removeprefix("gs://"))
    namespace: dict = {}
    exec(compile(code, name, "exec"), namespace)
    assert namespace["t"].num_rows == 4


def _readme_train_commands() -> list[list[str]]:
    """The arguments of every `tunix-tasks train` line in the README's bash blocks."""
    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)
    lines = [ln.split("#", 1)[0] for b in blocks for ln in b.splitlines()]
    return [shlex.split(ln)[2:] for ln in lines if re.match(r"\S*tunix-tasks train\b", ln)]


def test_readme_train_lines_that_start_a_new_kind_of_run_name_it():
    """Issue #31.1: a README line that changes what its config trains (mode, actor kind,
    model, ...) gives the run its own `--run-name`; one that reuses its config's run
    changes only what a resume may change, so it resumes that run instead of being
    refused."""
    from tunix_tasks.config import fixed_changes, load_config
    from tunix_tasks.frontdoor.cli import _config, build_parser, train_overrides

    commands = _readme_train_commands()
    assert len(commands) >= 5, commands
    for argv in commands:
        args = build_parser().parse_args(["train", *argv])
        cfg = _config(args, train_overrides(args))
        base = load_config(args.config)  # the run the config file names (e.g. make demo's)
        if cfg.run_uri == base.run_uri:  # resumes that run: it must not be refused
            assert [str(c) for c in fixed_changes(base, cfg)] == [], argv
