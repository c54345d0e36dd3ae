"""Model families against Hugging Face `transformers`: committed tiny checkpoints and the
reference outputs transformers produced for them (tests/fixtures/hf/make_fixtures.py).

Logits within 1e-4 (fp32), identical greedy tokens through our KV-cache sampler, the packed
training forward equal to per-sequence logits, and clear load errors for bad checkpoints.
No torch needed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tests.mistral_forms import mistral_checkpoint
from tests.paths import HF_FIXTURES, REPO
from tunix_tasks.policy.hf_checkpoint import CheckpointError, HFCheckpoint, params_from_hf
from tunix_tasks.policy.params import flat_params
from tunix_tasks.policy.sampling import Sampler
from tunix_tasks.policy.spec import (
    UnsupportedCheckpoint,
    rope_attention_factor,
    rope_inv_freq,
    spec_from_hf_config,
)

FIXTURES = HF_FIXTURES
# tiny-qwen3-yarn: yarn rope scaling (interpolated frequencies, scaled q and k); tiny-gemma3:
# a sliding layer (window 4) and a global one, sandwich norms, scaled embeddings, GeGLU;
# tiny-mistral: every layer sliding (window 4).
FAMILIES = (
    "tiny-qwen3",
    "tiny-llama3",
    "tiny-qwen2",
    "tiny-qwen3-yarn",
    "tiny-gemma3",
    "tiny-mistral",
)
ATOL = 1e-4


def _reference(name: str) -> dict:
    return json.loads((FIXTURES / name / "reference.json").read_text())


def _load(name: str, path: Path | None = None):
    ckpt = HFCheckpoint(str(path or FIXTURES / name))
    return ckpt.load_model(ckpt.spec(max_seq_len=64))


@nnx.jit
def _forward(model, tokens, positions, segments):
    return model(tokens, positions, segments)


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(name):
    ref = _reference(name)
    ids = np.asarray(ref["input_ids"], np.int32)
    expected = np.load(FIXTURES / name / "logits.npy")
    model = _load(name)
    b, t = ids.shape
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    logits = np.asarray(_forward(model, ids, positions, np.ones_like(ids)))
    assert logits.shape == expected.shape
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_row_matches_transformers(name):
    """Both reference sequences packed into one row (segment ids, restarted positions)."""
    ref = _reference(name)
    ids = np.asarray(ref["input_ids"], np.int32)
    expected = np.load(FIXTURES / name / "logits.npy")
    model = _load(name)
    b, t = ids.shape
    row = ids.reshape(1, b * t)
    positions = np.tile(np.arange(t, dtype=np.int32), b)[None]
    segments = np.repeat(np.arange(1, b + 1, dtype=np.int32), t)[None]
    logits = np.asarray(_forward(model, row, positions, segments)).reshape(b, t, -1)
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_continuations_match_transformers(name):
    ref = _reference(name)
    model = _load(name)
    # A stop id no greedy path reaches: the reference generated every token.
    sampler = Sampler(model, pad_id=0, stop_ids=(-2,), batch_buckets=(1, 2), prompt_buckets=(16,))
    cases = ref["greedy"]
    out = sampler.sample(
        [c["prompt_ids"] for c in cases],
        max_new_tokens=len(cases[0]["output_ids"]),
        top_k=1,
        rng=jax.random.key(0),
    )
    for case, sample in zip(cases, out, strict=True):
        assert sample.tokens == case["output_ids"]


def test_both_rope_config_forms_are_read():
    llama = json.loads((FIXTURES / "tiny-llama3" / "config.json").read_text())
    qwen = json.loads((FIXTURES / "tiny-qwen3" / "config.json").read_text())
    spec = spec_from_hf_config(llama, max_seq_len=64)
    assert spec.rope_scaling is not None and spec.rope_scaling.factor == 8.0
    assert spec.family == "llama" and not spec.tie_embeddings and spec.n_kv_heads == 2
    spec = spec_from_hf_config(qwen, max_seq_len=64)
    assert spec.family == "qwen3" and spec.qk_norm and spec.tie_embeddings
    assert spec.head_dim * spec.n_heads != spec.d_model  # head_dim from config.json
    # The same llama rope written the newer way gives the same spec.
    newer = {k: v for k, v in llama.items() if k not in ("rope_theta", "rope_scaling")}
    newer["rope_parameters"] = {"rope_theta": llama["rope_theta"], **llama["rope_scaling"]}
    assert spec_from_hf_config(newer, max_seq_len=64) == spec_from_hf_config(llama, max_seq_len=64)


ROPE_REFERENCE = json.loads((FIXTURES / "rope_reference.json").read_text())["cases"]


@pytest.mark.parametrize("case", sorted(ROPE_REFERENCE))
def test_rope_scalings_match_transformers(case):
    """llama3, linear and yarn (truncated or not, DeepSeek's mscale ratio, an explicit
    attention factor and betas): transformers' own frequencies and cos/sin factor."""
    ref = ROPE_REFERENCE[case]
    config = {
        **ref["config"],
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 400,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
    }
    spec = spec_from_hf_config(config, max_seq_len=64)
    np.testing.assert_allclose(rope_inv_freq(spec), ref["inv_freq"], rtol=2e-6, atol=0)
    assert rope_attention_factor(spec) == pytest.approx(ref["attention_factor"], rel=1e-12)


def test_yarn_fixture_differs_from_plain_rope():
    """The yarn fixture's logits are yarn's: read with its scaling removed they are not."""
    cfg = json.loads((FIXTURES / "tiny-qwen3-yarn" / "config.json").read_text())
    plain = spec_from_hf_config({**cfg, "rope_scaling": None}, max_seq_len=64)
    yarn = spec_from_hf_config(cfg, max_seq_len=64)
    assert rope_attention_factor(yarn) == pytest.approx(0.1 * np.log(4.0) + 1)
    ramp = rope_inv_freq(yarn) / rope_inv_freq(plain)
    # interpolated (1/4), on the ramp, and kept (1): every regime is exercised
    assert ramp.min() == pytest.approx(0.25) and ramp.max() == pytest.approx(1.0)
    assert ((ramp > 0.26) & (ramp < 0.99)).any()


@pytest.mark.parametrize(
    "scaling,message",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, r"rope scaling 'dynamic' is not supported"),
        ({"rope_type": "yarn"}, r"rope scaling lacks 'factor'"),
        ({"rope_type": "linear", "factor": "2"}, r"factor must be a number"),
        ({"rope_type": "yarn", "factor": -4.0}, r"factor must be > 0"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1e30},
            r"original_max_position_embeddings must be an integer",
        ),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary"),
    ],
)
def test_bad_rope_scaling_is_refused_in_one_line(scaling, message):
    cfg = json.loads((FIXTURES / "tiny-qwen3" / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg |= {"rope_theta": 1e6, "rope_scaling": scaling}
    with pytest.raises(UnsupportedCheckpoint, match=message):
        spec_from_hf_config(cfg, max_seq_len=64)


@pytest.mark.parametrize(
    "changes,max_seq_len,refused",
    [
        ({"use_sliding_window": True, "sliding_window": 4096}, 4096, False),  # never binds
        ({"use_sliding_window": True, "sliding_window": 4096}, 4097, True),
        ({"use_sliding_window": True, "sliding_window": None}, 64, True),
        ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 32}, 64, True),
        ({"layer_types": ["full_attention"] * 2, "sliding_window": 32}, 64, False),
        ({"use_sliding_window": False, "sliding_window": 32}, 64, False),  # Qwen2.5's files
    ],
)
def test_sliding_window_is_refused_only_where_it_drops_keys(changes, max_seq_len, refused):
    cfg = json.loads((FIXTURES / "tiny-qwen2" / "config.json").read_text()) | changes
    if not refused:
        assert spec_from_hf_config(cfg, max_seq_len=max_seq_len).max_seq_len == max_seq_len
        return
    with pytest.raises(UnsupportedCheckpoint, match=r"sliding-window attention .* max_seq_len"):
        spec_from_hf_config(cfg, max_seq_len=max_seq_len)


@pytest.mark.parametrize(
    "change",
    [
        {"layer_windows": (0, 0)},  # no sliding window
        {"rope_local_theta": 0.0},  # the sliding layer on the global rope
        {"query_scale": 0.0},  # scores by head_dim ** -0.5
        {"norm_offset": 0.0},  # norm scales read as stored
        {"embed_scale": False},
        {"activation": "silu"},
    ],
    ids=lambda change: next(iter(change)),
)
def test_each_gemma3_option_is_needed(change):
    """The Gemma 3 fixture exercises every option: without any one of them the logits
    leave transformers' (so the match above is not by chance)."""
    ref = _reference("tiny-gemma3")
    ids = np.asarray(ref["input_ids"], np.int32)
    expected = np.load(FIXTURES / "tiny-gemma3" / "logits.npy")
    ckpt = HFCheckpoint(str(FIXTURES / "tiny-gemma3"))
    model = ckpt.load_model(dataclasses.replace(ckpt.spec(max_seq_len=64), **change))
    b, t = ids.shape
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    logits = np.asarray(_forward(model, ids, positions, np.ones_like(ids)))
    assert np.abs(logits - expected).max() > 100 * ATOL


def test_gemma3_config_forms_give_one_spec():
    """The published form (`sliding_window_pattern`, `rope_local_base_freq`, `rope_scaling`)
    and the one transformers 5 writes (`layer_types`, `rope_parameters` per layer type)."""
    published = json.loads((FIXTURES / "tiny-gemma3" / "config.json").read_text())
    spec = spec_from_hf_config(published, max_seq_len=64)
    assert spec.family == "gemma3" and spec.layer_windows == (4, 0)
    assert spec.rope_local_theta == 10_000.0 and spec.rope_scaling.factor == 2.0
    assert spec.query_scale == pytest.approx(24**-0.5) and spec.activation == "gelu_tanh"
    newer = {
        k: v
        for k, v in published.items()
        if k not in ("sliding_window_pattern", "rope_local_base_freq", "rope_theta", "rope_scaling")
    }
    newer["layer_types"] = ["sliding_attention", "full_attention"]
    newer["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    assert spec_from_hf_config(newer, max_seq_len=64) == spec
    # transformers' default pattern: every sixth layer global
    six = {**published, "num_hidden_layers": 12}
    del six["sliding_window_pattern"]
    assert spec_from_hf_config(six, max_seq_len=64).layer_windows == ((4,) * 5 + (0,)) * 2


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping is not supported"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
        ({"use_bidirectional_attention": True}, "bidirectional attention"),
        ({"layer_types": ["sliding_attention"]}, "layer_types must list 2"),
        ({"layer_types": ["local", "global"]}, "layer_types must list 2"),
        ({"sliding_window": None}, "sliding_window must be a positive integer"),
        ({"sliding_window_pattern": 0}, "sliding_window_pattern must be a positive integer"),
        ({"hidden_activation": "relu"}, "hidden activation 'relu' is not supported"),
        ({"rope_local_base_freq": -1}, "rope_local_base_freq must be > 0"),
        ({"query_pre_attn_scalar": "24"}, "query_pre_attn_scalar must be a number"),
    ],
)
def test_bad_gemma3_config_is_refused_in_one_line(changes, message):
    cfg = json.loads((FIXTURES / "tiny-gemma3" / "config.json").read_text()) | changes
    with pytest.raises(UnsupportedCheckpoint, match=message):
        spec_from_hf_config(cfg, max_seq_len=64)


def test_mistral_windows_bind_and_are_needed():
    """Mistral's `sliding_window` slides every layer; the fixture's 4 binds inside its
    12-token rows, so full attention leaves transformers' logits."""
    ckpt = HFCheckpoint(str(FIXTURES / "tiny-mistral"))
    spec = ckpt.spec(max_seq_len=64)
    assert spec.family == "mistral" and spec.layer_windows == (4, 4)
    assert not spec.tie_embeddings and not spec.qk_norm and not spec.rope_local_theta
    ref = _reference("tiny-mistral")
    ids = np.asarray(ref["input_ids"], np.int32)
    model = ckpt.load_model(dataclasses.replace(spec, layer_windows=()))
    b, t = ids.shape
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    logits = np.asarray(_forward(model, ids, positions, np.ones_like(ids)))
    expected = np.load(FIXTURES / "tiny-mistral" / "logits.npy")
    assert np.abs(logits - expected).max() > 100 * ATOL


@pytest.mark.parametrize(
    "changes,max_seq_len,windows",
    [
        ({"sliding_window": None}, 64, ()),  # v0.2 and later: full attention
        ({"sliding_window": 64}, 64, ()),  # drops no key at this length: full is the same
        ({"sliding_window": 63}, 64, (63, 63)),
        ({}, 4096, (4, 4)),
    ],
)
def test_mistral_window_is_kept_only_where_it_drops_keys(changes, max_seq_len, windows):
    cfg = json.loads((FIXTURES / "tiny-mistral" / "config.json").read_text()) | changes
    assert spec_from_hf_config(cfg, max_seq_len=max_seq_len).layer_windows == windows


def test_mistral_config_defaults_are_mistralconfigs():
    """A config.json without the keys gets MistralConfig's values: untied embeddings, a
    window of 4096, rope theta 10,000, 8 key/value heads (the decoder's defaults differ:
    tied, none, as many as the query heads)."""
    cfg = json.loads((FIXTURES / "tiny-mistral" / "config.json").read_text())
    for key in ("tie_word_embeddings", "sliding_window", "rope_theta", "num_key_value_heads"):
        del cfg[key]
    spec = spec_from_hf_config(cfg | {"num_attention_heads": 16}, max_seq_len=8192)
    assert not spec.tie_embeddings and spec.layer_windows == (4096, 4096)
    assert spec.rope_theta == 10_000.0 and spec.n_kv_heads == 8


@pytest.mark.parametrize("window", [0, -4, 4.0, "4", True, 1 << 25])
def test_a_bad_mistral_window_is_refused_in_one_line(window):
    cfg = json.loads((FIXTURES / "tiny-mistral" / "config.json").read_text())
    with pytest.raises(UnsupportedCheckpoint, match="sliding_window must be a positive integer"):
        spec_from_hf_config(cfg | {"sliding_window": window}, max_seq_len=64)


def test_mistral_full_layers_between_sliding_ones_are_refused_where_the_window_binds():
    """Ministral's interleaving (`layer_types`): transformers' MistralForCausalLM slides
    every layer anyway, so only a context the window covers is exact."""
    cfg = json.loads((FIXTURES / "tiny-mistral" / "config.json").read_text())
    cfg["layer_types"] = ["full_attention", "sliding_attention"]
    with pytest.raises(UnsupportedCheckpoint, match="max_seq_len at most 4"):
        spec_from_hf_config(cfg, max_seq_len=64)
    assert spec_from_hf_config(cfg, max_seq_len=4).layer_windows == ()


# ---------------------------------------------------------------- bad checkpoints


def _copy(tmp_path: Path, name: str = "tiny-qwen3") -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def test_streamed_and_in_memory_conversions_give_the_loaded_params():
    """`HFCheckpoint.tensors` (one at a time, over a sharded checkpoint here) and
    `params_from_hf` (a whole state dict) give exactly the params `load_model` holds."""
    d = FIXTURES / "tiny-llama3"
    ckpt = HFCheckpoint(str(d))
    spec = ckpt.spec(max_seq_len=64)
    loaded = flat_params(ckpt.load_model(spec))
    streamed = dict(ckpt.tensors(spec))
    state = {k: v for p in sorted(d.glob("*.safetensors")) for k, v in load_file(p).items()}
    in_memory = params_from_hf(state, spec)
    assert streamed.keys() == in_memory.keys() == loaded.keys()
    for name, value in loaded.items():
        assert streamed[name].dtype == in_memory[name].dtype == np.float32
        np.testing.assert_array_equal(np.asarray(streamed[name]), value, err_msg=name)
        np.testing.assert_array_equal(np.asarray(in_memory[name]), value, err_msg=name)
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor.*layers\.1\.mlp\.up_proj"):
        params_from_hf(state, spec)


def test_missing_tensor_is_named(tmp_path):
    d = _copy(tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: missing tensor.*layers\.1\.mlp\.up_proj"
    ):
        _load("", d)


def test_wrong_shape_names_file_and_tensor(tmp_path):
    d = _copy(tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors[
        "model.layers.0.self_attn.k_proj.weight"
    ][:-1]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape",
    ):
        _load("", d)


def test_unknown_architecture_is_refused(tmp_path):
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MambaForCausalLM"], "mamba"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"config\.json: unsupported architecture.*Qwen3ForCausalLM"
    ):
        _load("", d)
    with pytest.raises(UnsupportedCheckpoint):
        spec_from_hf_config(cfg, max_seq_len=64)


def _with_config(tmp_path: Path, **changes) -> HFCheckpoint:
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))
    return HFCheckpoint(str(d))


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_hidden_layers", 10_000_000),
        ("vocab_size", 10**12),
        ("hidden_size", 2**40),
        ("num_key_value_heads", -2),
        ("head_dim", 1.5),
        ("intermediate_size", True),
    ],
)
def test_config_shape_fields_are_bounded(tmp_path, field, value):
    """Issue #30.8: `num_hidden_layers: 10^7` stalled the fail-fast check past 60 s listing
    tens of millions of expected tensors; a vocabulary of 10^12 likewise."""
    ckpt = _with_config(tmp_path, **{field: value})
    with pytest.raises(
        CheckpointError, match=rf"config\.json: {field} must be a positive integer at most \d+"
    ):
        ckpt.verify(max_seq_len=64)


def test_config_is_compared_with_the_headers_before_building(tmp_path):
    """Within the bounds, a config.json that disagrees with the weights is named from the
    headers' layer count and embedding, before any expected tensor is listed."""
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: config\.json says num_hidden_layers=1000, the safetensors "
        r"headers hold 2 layers",
    ):
        _with_config(tmp_path / "a", num_hidden_layers=1000).verify(max_seq_len=64)
    with pytest.raises(
        CheckpointError,
        match=r"model\.embed_tokens\.weight has shape .*\(vocab_size, hidden_size\)",
    ):
        _with_config(tmp_path / "b", vocab_size=4_000_000).verify(max_seq_len=64)


@pytest.mark.parametrize("damage", ["header_length", "header_json", "truncated"])
def test_corrupt_safetensors_is_named(tmp_path, damage):
    d = _copy(tmp_path, "tiny-llama3")
    f = d / "model-00002-of-00002.safetensors"
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    if damage == "header_length":
        raw[:8] = struct.pack("<Q", len(raw) * 4)
    elif damage == "header_json":
        raw[8 : 8 + 16] = b"{not json at all"
    else:
        raw = raw[: 8 + n + 10]
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors"):
        _load("", d)


def test_index_cannot_point_outside_the_checkpoint(tmp_path):
    d = _copy(tmp_path, "tiny-llama3")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../../etc/passwd.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="bad file name"):
        _load("", d)


def test_prepare_refuses_a_bad_checkpoint_before_any_process_starts(tmp_path):
    from tunix_tasks.config import ConfigError
    from tunix_tasks.frontdoor.entrypoints import prepare_run

    d = _copy(tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, d / "model.safetensors")
    params = {"store": str(tmp_path / "runs"), "model": {"checkpoint": str(d)}}
    with pytest.raises(
        ConfigError,
        match=r"model\.checkpoint: .*model\.safetensors: missing tensor\(s\) model\.norm\.weight",
    ):
        prepare_run(params, run_name="bad")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"model\.checkpoint: .*tokenizer\.json: not found"):
        prepare_run(params, run_name="bad")
    # Issue #30.9: a missing directory is named as such, not as a missing tokenizer.json.
    missing = {**params, "model": {"checkpoint": str(tmp_path / "nope")}}
    with pytest.raises(ConfigError, match=r"nope: no config\.json there: the directory does not"):
        prepare_run(missing, run_name="bad")
    assert not (tmp_path / "runs" / "bad").exists()  # nothing written for a bad run


def test_prepare_refuses_a_template_without_a_tool_role_for_a_tool_env(tmp_path):
    """Gemma 3's template alternates user and model turns: with the calculator's tools the
    run is refused at prepare (else every actor stopped at its first tool result); a task
    whose replies are the user's runs."""
    from tunix_tasks.config import ConfigError
    from tunix_tasks.frontdoor.entrypoints import prepare_run

    model = {"checkpoint": str(FIXTURES / "tiny-gemma3"), "max_seq_len": 256}
    params = {"store": str(tmp_path / "runs"), "model": model}
    with pytest.raises(ConfigError, match=r"cannot carry a tool call and its result .* alternate"):
        prepare_run({**params, "env": {"name": "calculator"}}, run_name="tools")
    assert not (tmp_path / "runs" / "tools").exists()
    assert prepare_run({**params, "env": {"name": "guess_number"}}, run_name="turns")
    qwen = {**params, "model": {**model, "checkpoint": str(FIXTURES / "tiny-qwen3")}}
    assert prepare_run({**qwen, "env": {"name": "calculator"}}, run_name="qwen")
    # Mistral's renders one once the call is named as the rollout names it (9 characters)
    mistral = {**params, "model": {**model, "checkpoint": str(FIXTURES / "tiny-mistral")}}
    assert prepare_run({**mistral, "env": {"name": "calculator"}}, run_name="mistral")


def test_prepare_warns_when_a_template_takes_one_tool_call_a_turn(tmp_path, caplog):
    """Llama 3.1's template raises on a turn of two calls (as transformers' does: the
    `two_tool_calls` fixture): a run with tools prepares, warned that such an episode
    ends `truncated`; Qwen3's takes both, and a run without tools is not warned."""
    from tunix_tasks.frontdoor.entrypoints import prepare_run

    def warned(checkpoint: str, env: str) -> list[str]:
        caplog.clear()
        model = {"checkpoint": str(FIXTURES / checkpoint), "max_seq_len": 256}
        params = {"store": str(tmp_path / "runs"), "model": model, "env": {"name": env}}
        assert prepare_run(params, run_name=f"{checkpoint}-{env}")
        return [r.getMessage() for r in caplog.records if "tool call a turn" in r.getMessage()]

    with caplog.at_level("WARNING", logger="tunix_tasks.frontdoor.entrypoints"):
        [line] = warned("tiny-llama3", "calculator")
        assert "only supports single tool-calls at once" in line and "'truncated'" in line
        assert warned("tiny-qwen3", "calculator") == []
        assert warned("tiny-llama3", "guess_number") == []


@pytest.mark.parametrize("form", ["v7", "v11", "v13"])
def test_prepare_accepts_tool_calls_in_mistrals_other_forms(tmp_path, form):
    """mistral-common's v7 template (its list right only with JSON-string arguments), and
    the newer ones that write each call as `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` (v11)
    or without the id (v13 and later): the `mistral` parser reads each call as the template
    writes it, so a run with tools prepares (tests/mistral_forms.py)."""
    from tunix_tasks.frontdoor.entrypoints import prepare_run

    d = mistral_checkpoint(tmp_path / "ckpt", form)
    params = {"store": str(tmp_path / "runs"), "model": {"checkpoint": str(d), "max_seq_len": 256}}
    assert prepare_run({**params, "env": {"name": "calculator"}}, run_name="tools")


def test_prepare_refuses_a_template_whose_calls_the_parser_cannot_read(tmp_path, caplog):
    """A call as the template writes it (what its model learnt to write) must read back as
    that call: Qwen3's `<tool_call>` blocks under the `mistral` parser read as plain text,
    so a run with tools is refused, naming the parser and what it read; without tools it
    runs; an agent program's run (its tools unknown until it runs) is warned."""
    from tunix_tasks.config import ConfigError
    from tunix_tasks.frontdoor.entrypoints import prepare_run

    model = {"checkpoint": str(FIXTURES / "tiny-qwen3"), "max_seq_len": 256}
    params = {"store": str(tmp_path / "runs"), "model": {**model, "tool_format": "mistral"}}
    with pytest.raises(ConfigError) as info:
        prepare_run({**params, "env": {"name": "calculator"}}, run_name="tools")
    msg = str(info.value)
    assert "writes a call as '<tool_call>" in msg and "'mistral' tool-call parser" in msg
    assert "0 calls" in msg and "['hermes', 'llama3_json', 'mistral']" in msg
    assert not (tmp_path / "runs" / "tools").exists()
    assert prepare_run({**params, "env": {"name": "guess_number"}}, run_name="turns")
    assert prepare_run({**params, "model": model, "env": {"name": "calculator"}}, run_name="ok")
    agent = {"kind": "agent", "agent": {"program": "answer_agent:run"}}
    with caplog.at_level("WARNING"):
        assert prepare_run({**params, "actor": agent}, run_name="agent")
    assert any("agent program that passes tools" in r.getMessage() for r in caplog.records)


def test_build_policy_raises_policy_error_for_every_checkpoint_problem(tmp_path):
    """Issue #30.9: build_policy / build_sampler let `CheckpointError` through for problems
    found while loading (here a tensor missing), `PolicyError` for others."""
    from tunix_tasks.config import ModelConfig
    from tunix_tasks.policy.build import PolicyError, build_policy

    d = _copy(tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, d / "model.safetensors")
    cfg = ModelConfig(checkpoint=str(d), max_seq_len=64)
    with pytest.raises(PolicyError, match=r"missing tensor\(s\) model\.norm\.weight"):
        build_policy(cfg)
    (d / "config.json").write_text("{")
    with pytest.raises(PolicyError, match=r"config\.json: not valid JSON"):
        build_policy(cfg)


def test_the_models_doc_config_validates():
    import re

    import yaml

    from tunix_tasks.config import config_from_dict

    doc = (REPO / "docs" / "models.md").read_text()
    snippet = re.search(r"```yaml\n(.*?)```", doc, re.S).group(1)
    cfg = config_from_dict(yaml.safe_load(snippet))
    assert cfg.model.checkpoint == "gs://team/models/qwen3-1.7b" and cfg.model.max_seq_len == 4096
