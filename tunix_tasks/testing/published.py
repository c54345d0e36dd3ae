"""The shapes and published sizes of released Qwen3 and Llama 3.1 models, no weights.

`PUBLISHED_CONFIGS` holds the fields of each model's `config.json` that `DecoderSpec`
reads, under the same keys; `published_spec(name)` is its spec. They check the cost model
(`policy/costs.py`) against the published parameter counts and feed the memory tables of
`benchmarks/model_memory.py`. Sources (stored public copies of the files):
  Qwen3-0.6B     huggingface.co/Qwen/Qwen3-0.6B/raw/main/config.json; cross-checked with
                 AI-Hypercomputer/maxtext src/MaxText/configs/models/qwen3-0.6b.yml
  Qwen3-8B       huggingface.co/Qwen/Qwen3-8B config.json as quoted in citsjtu2020/LLM-Prof
                 sglang/Model_Config.md; maxtext .../models/qwen3-8b.yml
  Llama-3.1-8B   huggingface.co/meta-llama/Llama-3.1-8B config.json as quoted in
                 citsjtu2020/LLM-Prof sglang/Model_Config.md; maxtext .../llama3.1-8b.yml
  Llama-3.1-70B  huggingface.co/meta-llama/Llama-3.1-70B config.json (public copies of it);
                 maxtext .../models/llama3.1-70b.yml
The Llama configs carry no `head_dim`: transformers then uses hidden_size //
num_attention_heads (= 128, as maxtext's `head_dim: 128`). Qwen3 adds an RMSNorm over
head_dim to q and to k in every layer. No biases anywhere.
"""

from __future__ import annotations

from typing import Any

from tunix_tasks.policy.spec import DecoderSpec, spec_from_hf_config

__all__ = ["PUBLISHED_CONFIGS", "PUBLISHED_PARAMS", "published_spec"]

_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
}
_LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "rope_theta": 500_000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
PUBLISHED_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": {
        **_QWEN3,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "tie_word_embeddings": True,
    },
    "Qwen3-8B": {
        **_QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "tie_word_embeddings": False,
    },
    "Llama-3.1-8B": {
        **_LLAMA31,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
    "Llama-3.1-70B": {
        **_LLAMA31,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
}

#: Published sizes: the Qwen model cards ("Number of Parameters: 0.6B", "8.2B"); the
#: Hugging Face hub's size of the Llama-3.1 safetensors (8.03B, 70.6B).
PUBLISHED_PARAMS: dict[str, float] = {
    "Qwen3-0.6B": 0.6e9,
    "Qwen3-8B": 8.2e9,
    "Llama-3.1-8B": 8.03e9,
    "Llama-3.1-70B": 70.6e9,
}


def published_spec(name: str) -> DecoderSpec:
    """The `DecoderSpec` of a `PUBLISHED_CONFIGS` model, at its full context length."""
    config = PUBLISHED_CONFIGS[name]
    return spec_from_hf_config(config, max_seq_len=config["max_position_embeddings"])
