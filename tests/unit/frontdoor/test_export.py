"""Tests for `tunix-tasks export` (tunix_tasks/frontdoor/export.py) and the PEFT adapter
format it writes (tunix_tasks/policy/hf_adapters.py), against references: the committed
tiny checkpoints (made by `transformers`) and a LoRA adapter made and applied by `peft`
(tests/fixtures/hf/tiny-qwen3-lora, make_peft_fixture.py). No torch needed."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from tests.paths import HF_FIXTURES
from tunix_tasks.config import config_from_dict
from tunix_tasks.frontdoor import export
from tunix_tasks.frontdoor.cli import main
from tunix_tasks.frontdoor.export import ExportError, export_snapshot
from tunix_tasks.policy.build import base_fingerprint, build_policy, lora_spec
from tunix_tasks.policy.hf_adapters import (
    adapters_from_peft,
    adapters_to_peft,
    lora_from_peft_config,
    peft_config,
)
from tunix_tasks.policy.hf_checkpoint import CheckpointError, HFCheckpoint
from tunix_tasks.policy.params import flat_params, load_flat_params
from tunix_tasks.storage.runs import write_config
from tunix_tasks.storage.weights import WeightsError, WeightsPublisher

BASE = HF_FIXTURES / "tiny-qwen3"
LORA = HF_FIXTURES / "tiny-qwen3-lora"
ATOL = 1e-4  # fp32 logits, as tests/unit/policy/test_hf_models.py


def _logits(model) -> np.ndarray:
    ids = np.asarray(json.loads((BASE / "reference.json").read_text())["input_ids"], np.int32)
    b, t = ids.shape
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    return np.asarray(
        nnx.jit(lambda m, x, p, s: m(x, p, s))(model, ids, positions, np.ones_like(ids))
    )


def _peft():
    """PEFT's adapter: (its tensors, its config, our LoraSpec of it, the base's spec)."""
    config = json.loads((LORA / "adapter_config.json").read_text())
    lora = lora_from_peft_config(config)
    spec = HFCheckpoint(str(BASE)).spec(max_seq_len=64)
    return load_file(str(LORA / "adapter_model.safetensors")), config, lora, spec


# ------------------------------------------------------------------ PEFT's format


def test_a_peft_adapter_gives_peft_logits_and_round_trips_exactly():
    tensors, config, lora, spec = _peft()
    assert (lora.rank, lora.alpha, set(lora.targets)) == (4, 8.0, {*"qkvo", "gate", "up", "down"})
    ckpt = HFCheckpoint(str(BASE))
    model = ckpt.load_model(spec, lora=lora)
    base_logits = _logits(model)
    load_flat_params(model, adapters_from_peft(tensors, spec, lora), nnx.LoRAParam)
    expected = np.load(LORA / "logits.npy")
    np.testing.assert_allclose(_logits(model), expected, atol=ATOL, rtol=0)
    assert np.abs(expected - base_logits).max() > 1.0  # the adapter matters
    back = adapters_to_peft(flat_params(model, nnx.LoRAParam), spec, lora)
    assert set(back) == set(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    ours = peft_config(lora, base="tiny-qwen3")
    assert {k: config.get(k) for k in ours} == ours  # every field we write, as PEFT wrote it


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"peft_type": "IA3"}, "only LORA"),
        ({"use_dora": True}, "use_dora"),
        ({"use_rslora": True}, "use_rslora"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
        ({"target_modules": "all-linear"}, "a list"),
        ({"target_modules": [{"a": 1}]}, "a list of module names"),  # not a TypeError
        ({"target_modules": [["q_proj"]]}, "a list of module names"),
        ({"r": 0}, "r >= 1"),
        ({"r": True}, "r >= 1"),
        ({"lora_alpha": float("inf")}, "alpha > 0"),
        ({"lora_alpha": float("nan")}, "finite alpha > 0"),
        ({"lora_alpha": 10**400}, "finite alpha > 0"),  # not an OverflowError
        ({"alora_invocation_tokens": [7, 8]}, "alora_invocation_tokens"),  # activated LoRA
        ({"layers_to_transform": 0}, "layers_to_transform"),  # 0 is a layer, not "off"
        ({"a_later_peft_option": "on"}, "a_later_peft_option"),
    ],
)
def test_an_adapter_ours_cannot_hold_is_refused_by_name(change, match):
    _, config, _, _ = _peft()
    with pytest.raises(CheckpointError, match=match):
        lora_from_peft_config(config | change)


def test_options_left_at_their_defaults_are_accepted():
    _, config, lora, _ = _peft()
    plain = {"modules_to_save": [], "layers_to_transform": None, "loftq_config": {}}
    assert lora_from_peft_config(config | plain | {"lora_dropout": 0.1}) == lora


def test_adapter_tensors_are_checked_by_name_and_shape():
    tensors, _, lora, spec = _peft()
    name = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    with pytest.raises(CheckpointError, match=r"missing adapter tensor .*layers\.1\.mlp\.up_proj"):
        adapters_from_peft({k: v for k, v in tensors.items() if k != name}, spec, lora)
    with pytest.raises(CheckpointError, match=r"up_proj\.lora_B\.weight has shape \[128, 3\]"):
        adapters_from_peft(tensors | {name: tensors[name][:, :3]}, spec, lora)
    with pytest.raises(CheckpointError, match="no place for"):
        adapters_from_peft(
            tensors | {"base_model.model.lm_head.lora_A.weight": tensors[name]}, spec, lora
        )


# ------------------------------------------------------------------ export


def _run(tmp_path, **model):
    cfg = config_from_dict(
        {
            "store": f"file://{tmp_path}/runs",
            "run_name": "r",
            "model": {"checkpoint": str(BASE), **model},
        }
    )
    return cfg, write_config(cfg)


def _lora_run(tmp_path, *, version: int = 0, base: dict | None = None):
    """A LoRA run of `tiny-qwen3` with PEFT's adapter published as its snapshot `version`,
    for the base it was trained on (or `base`): (its config, PEFT's tensors)."""
    tensors, _, lora, spec = _peft()
    cfg, store = _run(
        tmp_path, lora_rank=lora.rank, lora_alpha=lora.alpha, lora_targets=list(lora.targets)
    )
    assert lora_spec(cfg.model) == lora
    base = base or {"fingerprint": base_fingerprint(cfg.model, cfg.seed), "uri": str(BASE)}
    WeightsPublisher(store).publish(
        adapters_from_peft(tensors, spec, lora),
        version=version,
        step=version,
        model=cfg.model.model_dump(),
        kind="adapter",
        base=base,
    )
    return cfg, tensors


def test_a_full_snapshot_exports_as_the_checkpoint_it_came_from(tmp_path):
    """A fine-tuned snapshot becomes a Hugging Face folder: its tensors the snapshot's in
    Hugging Face names and layouts (loaded back, the same params), the base's config and
    tokenizer files beside them; untouched weights export bit for bit as the fixture
    `transformers` wrote; bfloat16 on request."""
    cfg, store = _run(tmp_path)
    _, model = build_policy(cfg.model, seed=0)
    base = flat_params(model)
    tuned = {k: v + 0.01 * (i % 7) for i, (k, v) in enumerate(base.items())}
    pub = WeightsPublisher(store)
    pub.publish(base, version=0, step=0, model=cfg.model.model_dump())
    pub.publish(tuned, version=1, step=10, model=cfg.model.model_dump())

    written = export_snapshot(cfg.run_uri, tmp_path / "v0", version=0)
    assert written["kind"] == "full" and written["dtype"] == "float32"
    assert (
        load_file(str(tmp_path / "v0/model.safetensors")).keys()
        == load_file(str(BASE / "model.safetensors")).keys()
    )
    for name, value in load_file(str(BASE / "model.safetensors")).items():
        np.testing.assert_array_equal(
            load_file(str(tmp_path / "v0/model.safetensors"))[name], value, err_msg=name
        )
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "v0" / file).read_bytes() == (BASE / file).read_bytes(), file

    export_snapshot(cfg.run_uri, tmp_path / "latest")  # v1, the latest
    back = HFCheckpoint(str(tmp_path / "latest"))
    loaded = dict(back.tensors(back.spec(max_seq_len=64)))
    assert loaded.keys() == tuned.keys()
    for name, value in tuned.items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), value, err_msg=name)

    written = export_snapshot(cfg.run_uri, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((tmp_path / "bf16/config.json").read_text())["dtype"] == "bfloat16"
    assert {str(v.dtype) for v in load_file(str(tmp_path / "bf16/model.safetensors")).values()} == {
        "bfloat16"
    }
    assert written["bytes"] < 0.6 * export_snapshot(cfg.run_uri, tmp_path / "f32")["bytes"]


def test_an_adapter_snapshot_exports_as_peft_wrote_it_or_merged(tmp_path):
    """A LoRA run's snapshot: as a PEFT folder, the tensors PEFT wrote (bit for bit) and a
    config PEFT reads; merged into the base, the tensors PEFT's `merge_and_unload` gave,
    whose logits are the adapted model's."""
    cfg, tensors = _lora_run(tmp_path, version=3)
    lora = lora_spec(cfg.model)

    written = export_snapshot(cfg.run_uri, tmp_path / "adapter")
    assert written["kind"] == "adapter" and sorted(
        p.name for p in (tmp_path / "adapter").iterdir()
    ) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    exported = load_file(str(tmp_path / "adapter/adapter_model.safetensors"))
    assert exported.keys() == tensors.keys()
    for name, value in tensors.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert lora_from_peft_config(config) == lora and config["base_model_name_or_path"] == str(BASE)

    written = export_snapshot(cfg.run_uri, tmp_path / "merged", merge=True)
    assert written["kind"] == "merged"
    ours = load_file(str(tmp_path / "merged/model.safetensors"))
    theirs = load_file(str(LORA / "merged.safetensors"))
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, atol=1e-5, rtol=0, err_msg=name)
    ckpt = HFCheckpoint(str(tmp_path / "merged"))
    np.testing.assert_allclose(
        _logits(ckpt.load_model(ckpt.spec(max_seq_len=64))),
        np.load(LORA / "logits.npy"),
        atol=ATOL,
        rtol=0,
    )


def test_what_cannot_be_exported_is_a_clear_error_and_writes_nothing(tmp_path, capsys):
    cfg, store = _run(tmp_path)
    with pytest.raises(WeightsError, match="no weights published yet"):
        export_snapshot(cfg.run_uri, tmp_path / "out")
    _, model = build_policy(cfg.model, seed=0)
    WeightsPublisher(store).publish(
        flat_params(model), version=0, step=0, model=cfg.model.model_dump()
    )
    with pytest.raises(ExportError, match="nothing to merge"):
        export_snapshot(cfg.run_uri, tmp_path / "out", merge=True)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep")
    with pytest.raises(ExportError, match="not an empty folder"):
        export_snapshot(cfg.run_uri, tmp_path / "taken")
    assert (
        not (tmp_path / "out").exists()
        and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    )

    preset = config_from_dict({"store": f"file://{tmp_path}/runs", "run_name": "p"})
    write_config(preset)
    assert main(["export", preset.run_uri, str(tmp_path / "p")]) == 2
    assert "this project's own architecture" in capsys.readouterr().err
    assert main(["export", cfg.run_uri, str(tmp_path / "v9"), "--version", "9"]) != 0
    assert "v00000009/manifest.json does not exist" in capsys.readouterr().err

    assert main(["export", cfg.run_uri, str(tmp_path / "cli")]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "full"
    assert (tmp_path / "cli" / "model.safetensors").is_file()


def test_a_full_disk_mid_write_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch, capsys):
    """The disk fills after some tensors are in (write() raises ENOSPC, naming no file):
    one line naming the file, exit status of a storage error, `dest` absent and no
    temporary folder beside it; the next export writes it whole."""
    cfg, store = _run(tmp_path)
    _, model = build_policy(cfg.model, seed=0)
    WeightsPublisher(store).publish(
        flat_params(model), version=0, step=0, model=cfg.model.model_dump()
    )
    init = export._SafetensorsFile.__init__

    class FullDisk:
        def __init__(self, file) -> None:
            self.file, self.writes = file, 0

        def write(self, data) -> int:
            self.writes += 1
            if self.writes == 5:
                raise OSError(28, "No space left on device")
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

    def filling(self, *args) -> None:
        init(self, *args)
        self._file = FullDisk(self._file)

    monkeypatch.setattr(export._SafetensorsFile, "__init__", filling)
    dest = tmp_path / "out" / "v0"
    assert main(["export", cfg.run_uri, str(dest)]) == 5  # EXIT_STORAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tunix-tasks: {err[0].split(': ', 1)[1]}"] and "model.safetensors" in err[0]
    assert "No space left on device" in err[0]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []
    monkeypatch.setattr(export._SafetensorsFile, "__init__", init)
    export_snapshot(cfg.run_uri, dest)
    assert (
        load_file(str(dest / "model.safetensors")).keys()
        == load_file(str(BASE / "model.safetensors")).keys()
    )


def test_dtypes_that_cannot_hold_the_weights_or_do_not_apply_are_refused(tmp_path, monkeypatch):
    """float16 cannot hold a weight of 1e5 (inf): refused naming the tensor, nothing
    written; `--dtype` on an adapter folder (kept as the snapshot holds it) is refused;
    "." exports into the current (empty) folder."""
    cfg, store = _run(tmp_path)
    _, model = build_policy(cfg.model, seed=0)
    flat = flat_params(model)
    flat["embed"] = flat["embed"] * 0 + 1e5
    WeightsPublisher(store).publish(flat, version=0, step=0, model=cfg.model.model_dump())
    with pytest.raises(ExportError, match=r"embed_tokens\.weight: values beyond float16's range"):
        export_snapshot(cfg.run_uri, tmp_path / "f16", dtype="float16")
    assert not (tmp_path / "f16").exists()
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert export_snapshot(cfg.run_uri, ".", dtype="bfloat16")["kind"] == "full"
    assert (tmp_path / "here" / "model.safetensors").is_file()

    lcfg, _ = _lora_run(tmp_path / "lora")
    with pytest.raises(ExportError, match="--dtype applies to full and merged folders"):
        export_snapshot(lcfg.run_uri, tmp_path / "a", dtype="bfloat16")
    assert export_snapshot(lcfg.run_uri, tmp_path / "m", dtype="bfloat16", merge=True)["dtype"] == (
        "bfloat16"
    )


def test_adapters_for_another_base_are_refused(tmp_path):
    cfg, _ = _lora_run(tmp_path, base={"fingerprint": "f" * 64, "uri": "gs://elsewhere/base"})
    with pytest.raises(ExportError, match="not that base now"):
        export_snapshot(cfg.run_uri, tmp_path / "out")


def _published_run(tmp_path):
    """A run of `tiny-qwen3` with its initial weights published as v0: (config, store)."""
    cfg, store = _run(tmp_path)
    _, model = build_policy(cfg.model, seed=0)
    WeightsPublisher(store).publish(
        flat_params(model), version=0, step=0, model=cfg.model.model_dump()
    )
    return cfg, store


def _one_line(capsys, code: int, argv: list[str], match: str) -> None:
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()  # after the progress bar's line
    assert len(err) == 1 and err[0].startswith("tunix-tasks: "), err
    assert re.search(match, err[0]), err


@pytest.mark.timeout(60)  # a FIFO blocked the export forever
def test_a_run_no_reader_could_parse_is_one_line_and_nothing_is_written(tmp_path, capsys):
    """config.json or manifest.json nested 100k deep (a RecursionError traceback before),
    a FIFO (a hang) or a 1 GiB sparse file (read whole): one line each, nothing written;
    the run exports once its files are whole again."""
    cfg, store = _published_run(tmp_path)
    dest = str(tmp_path / "out")
    config = store.local_path("config.json")
    manifest = store.local_path("weights/v00000000/manifest.json")
    good = {p: p.read_bytes() for p in (config, manifest)}
    deep = b"[" * 100_000 + b"]" * 100_000
    for path, code, what in ((config, 2, "not valid JSON"), (manifest, 1, "invalid manifest")):
        path.write_bytes(deep)
        _one_line(capsys, code, ["export", cfg.run_uri, dest], f"{what}.*nested too deeply")
        path.unlink()
        os.mkfifo(path)
        _one_line(capsys, code, ["export", cfg.run_uri, dest], "is a FIFO, not a regular file")
        path.unlink()
        with path.open("wb") as f:
            f.truncate(1 << 30)
        _one_line(capsys, code, ["export", cfg.run_uri, dest], "holds 1073741824 bytes, more")
        path.write_bytes(good[path])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert main(["export", cfg.run_uri, dest]) == 0


def test_a_dest_inside_the_run_or_a_negative_version_is_refused_up_front(tmp_path, capsys):
    """DEST under RUN (by its path, or a symlink into it) would write into the run's own
    store; a version below 0 named "weights/v-0000001". Each: one line, exit 2,
    nothing written."""
    cfg, store = _published_run(tmp_path)
    root = store.local_path()
    (tmp_path / "into").symlink_to(root / "weights")
    for dest in (root / "exported", tmp_path / "into" / "x"):
        _one_line(capsys, 2, ["export", cfg.run_uri, str(dest)], "is inside the run .*outside it")
    out = str(tmp_path / "out")
    _one_line(capsys, 2, ["export", cfg.run_uri, out, "--version", "-1"], "version must be >= 0")
    assert sorted(p.name for p in root.iterdir()) == [
        ".run_id.gens",
        "config.json",
        "run_id",
        "weights",
    ]
    assert sorted(p.name for p in (root / "weights").iterdir()) == [
        ".LATEST.gens",
        "LATEST",
        "v00000000",
    ]
    assert not (tmp_path / "out").exists()


def test_a_dest_symlinked_to_an_empty_folder_is_filled_through_the_link(tmp_path):
    """The link stays a link, the folder it points to gets the files (renamed onto it
    from beside it: complete or absent), nothing is left beside either; a link to
    nothing is refused up front."""
    cfg, _ = _published_run(tmp_path)
    (tmp_path / "models" / "empty").mkdir(parents=True)
    (tmp_path / "links").mkdir()
    link = tmp_path / "links" / "to_empty"
    link.symlink_to(tmp_path / "models" / "empty")
    written = export_snapshot(cfg.run_uri, link)
    assert written["dest"] == str(link) and written["kind"] == "full"
    assert link.is_symlink() and (tmp_path / "models/empty/model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["empty"]
    assert sorted(p.name for p in (tmp_path / "links").iterdir()) == ["to_empty"]

    (tmp_path / "links" / "dangling").symlink_to(tmp_path / "models" / "gone")
    with pytest.raises(ExportError, match="a symlink to nothing"):
        export_snapshot(cfg.run_uri, tmp_path / "links" / "dangling")
    assert not (tmp_path / "models" / "gone").exists()
