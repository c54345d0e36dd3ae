"""The policy every role shares: tokenizers, chat formats, decoder model, KV-cache sampler.

chat.py           the `Tokenizer` and `ChatFormat` protocols (token-in / token-out episodes)
tokenizer.py      the character tokenizer and its chat format (demo presets)
hf_tokenizer.py   a checkpoint's `tokenizer.json` through Hugging Face `tokenizers`
chat_template.py  a checkpoint's jinja chat template, rendered as `apply_chat_template` does
toolcalls.py      tool calls in the models' own formats (Hermes/Qwen, Llama 3.1 JSON)
spec.py           `DecoderSpec`: a family's architecture, from a preset or a config.json
model.py          decoder-only transformer (Flax NNX) for every family
params.py         flat named weights for snapshots
hf_checkpoint.py  Hugging Face safetensors checkpoints -> a sharded model
sampling.py       batched KV-cache sampling on bucketed shapes, behaviour log-probs
build.py          chat format + model (+ sampler) from a `ModelConfig`
"""
