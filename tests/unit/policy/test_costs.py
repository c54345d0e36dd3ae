"""policy/costs.py: parameter counts against published sizes and built models, FLOPs, bytes."""

from __future__ import annotations

import math

import pytest
from flax import nnx

from tunix_tasks.config import ModelConfig
from tunix_tasks.policy import costs
from tunix_tasks.policy.hf_checkpoint import hf_tensor_shapes
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.params import param_count
from tunix_tasks.policy.spec import DecoderSpec, spec_from_hf_config, spec_from_preset
from tunix_tasks.testing.published import PUBLISHED_CONFIGS, PUBLISHED_PARAMS, published_spec

LLAMA_8B = published_spec("Llama-3.1-8B")
QWEN3_06B = published_spec("Qwen3-0.6B")


def _hf_spec(arch: str, *, tied: bool) -> DecoderSpec:
    """A tiny Hugging Face-shaped spec: GQA, head_dim != d_model / heads."""
    config = {
        "architectures": [arch],
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 97,
        "rope_theta": 10_000.0,
        "tie_word_embeddings": tied,
    }
    return spec_from_hf_config(config, max_seq_len=64)


BUILT = {
    **{
        f"char-{p}": spec_from_preset(ModelConfig(preset=p), vocab_size=101)
        for p in ("tiny", "small", "base")
    },
    "qwen3-tied": _hf_spec("Qwen3ForCausalLM", tied=True),
    "llama-untied": _hf_spec("LlamaForCausalLM", tied=False),
    "qwen2-bias": _hf_spec("Qwen2ForCausalLM", tied=True),
    "gemma3-sandwich": _hf_spec("Gemma3ForCausalLM", tied=True),
}


@pytest.mark.parametrize("name", list(PUBLISHED_CONFIGS))
def test_param_count_matches_published_size(name):
    params, published = costs.total_params(published_spec(name)), PUBLISHED_PARAMS[name]
    assert abs(params - published) / published < 0.02, (name, params, published)


def test_param_counts_exact():
    # Known totals of the released checkpoints (tied lm_head counted once).
    assert costs.total_params(LLAMA_8B) == 8_030_261_248
    assert costs.total_params(published_spec("Llama-3.1-70B")) == 70_553_706_496
    assert costs.total_params(QWEN3_06B) == 596_049_920
    assert round(costs.non_embedding_params(QWEN3_06B) / 1e9, 2) == 0.44  # model card: 0.44B
    qwen8 = published_spec("Qwen3-8B")
    assert round(costs.non_embedding_params(qwen8) / 1e9, 2) == 6.95  # card: 6.95B
    # untied: the output layer is a second table; tied: the same one
    assert costs.total_params(qwen8) == costs.non_embedding_params(qwen8) + 2 * 151936 * 4096
    assert costs.total_params(QWEN3_06B) == costs.non_embedding_params(QWEN3_06B) + 151936 * 1024


def test_llama_head_dim_defaults_to_hidden_over_heads():
    assert "head_dim" not in PUBLISHED_CONFIGS["Llama-3.1-8B"]
    assert LLAMA_8B.head_dim == 4096 // 32 == 128
    assert QWEN3_06B.head_dim == 128  # explicit, != 1024 // 16
    assert QWEN3_06B.qk_norm and not LLAMA_8B.qk_norm


@pytest.mark.parametrize("name", list(BUILT))
def test_param_count_matches_the_built_model_and_checkpoint(name):
    spec = BUILT[name]
    model = nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(0)))
    assert costs.total_params(spec) == param_count(model)
    if spec.family != "char":  # what a Hugging Face checkpoint of it holds
        assert costs.total_params(spec) == sum(map(math.prod, hf_tensor_shapes(spec).values()))


def test_layer_options_add_their_params():
    llama, qwen3, qwen2 = BUILT["llama-untied"], BUILT["qwen3-tied"], BUILT["qwen2-bias"]
    base = costs.layer_params(llama)
    assert costs.layer_params(qwen3) == base + 2 * 16  # q and k norms over head_dim
    assert costs.layer_params(qwen2) == base + (4 + 2 * 2) * 16  # q, k, v biases
    gemma = BUILT["gemma3-sandwich"]  # q/k norms and each sublayer's output norm
    assert costs.layer_params(gemma) == costs.layer_params(qwen3) + 2 * 48


def test_flops_hand_example():
    s = BUILT["llama-untied"]  # d 48, f 80, L 3, H 4, KV 2, hd 16, V 97
    p_mm = 3 * (2 * 48 * 64 + 2 * 48 * 32 + 3 * 48 * 80) + 48 * 97
    assert costs.matmul_params(s) == p_mm
    assert costs.attention_flops(s, 2, 10) == 4 * 3 * 4 * 16 * 2 * 10
    assert costs.forward_flops_per_token(s, 10) == 2 * p_mm + 4 * 3 * 4 * 16 * 10
    assert costs.train_flops(s, 8, 10) == 3 * 8 * costs.forward_flops_per_token(s, 10)


def test_prefill_counts_the_output_layer_only_where_logits_are_needed():
    s, tokens, window = LLAMA_8B, 4 * 512, 1024
    every = costs.prefill_flops(s, tokens, window, logits=tokens)
    assert every == tokens * costs.forward_flops_per_token(s, window)
    last = costs.prefill_flops(s, tokens, window, logits=4)  # sampling: each row's last
    assert every - last == 2 * (tokens - 4) * 128256 * 4096
    assert last < every


def test_kv_cache_bytes_hand_example():
    # Llama-3.1-8B: 2 (K,V) * 32 layers * 8 kv heads * 128 head_dim * 2 bytes = 128 KiB/token
    assert costs.kv_bytes(LLAMA_8B, 1) == 2 * 32 * 8 * 128 * 2 == 131_072
    assert costs.kv_bytes(LLAMA_8B, 4096) == 512 * 2**20
    # Qwen3-0.6B: 2 * 28 * 8 * 128 * 2 = 114,688 bytes/token; an fp32 cache doubles it.
    assert costs.kv_bytes(QWEN3_06B, 32768) == 114_688 * 32768
    assert costs.kv_bytes(QWEN3_06B, 10, itemsize=4) == 2 * costs.kv_bytes(QWEN3_06B, 10)


def test_weight_bytes_and_what_a_step_reads():
    tied, untied = BUILT["qwen3-tied"], BUILT["llama-untied"]
    assert costs.weight_bytes(untied) == 2 * costs.total_params(untied)
    assert costs.weight_bytes(untied, itemsize=4) == 4 * costs.total_params(untied)
    assert costs.weight_read_bytes(tied, 3, 4) == costs.weight_bytes(tied, 4)  # output layer
    assert costs.weight_read_bytes(untied, 3, 4) == 4 * (
        costs.total_params(untied) - 97 * 48 + 3 * 48
    )


def test_learner_memory():
    assert costs.learner_state_bytes(LLAMA_8B, "fp32") == 16 * 8_030_261_248
    assert costs.learner_state_bytes(LLAMA_8B, "bf16") == 16 * 8_030_261_248
    assert costs.gathered_bytes(LLAMA_8B) == 4 * 128256 * 4096  # the vocab table > a layer
    a = costs.activation_bytes(LLAMA_8B, 2048)
    assert a["total"] == a["residuals"] + a["layer"] + a["logits"]
    assert a["residuals"] == 32 * 2048 * 4096 * 2
    assert a["logits"] == 2 * 2048 * 128256 * 4
    assert costs.activation_bytes(LLAMA_8B, 8192)["total"] > a["total"]
    # a smaller attention block holds fewer scores at once
    assert costs.activation_bytes(LLAMA_8B, 2048, 128)["layer"] < a["layer"]
