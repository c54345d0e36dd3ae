"""The policy every role shares: tokenizer, decoder model, KV-cache sampler.

tokenizer.py   the character tokenizer and its special tokens
model.py       decoder-only transformer (Flax NNX), flat weights for snapshots
sampling.py    batched KV-cache sampling on bucketed shapes, behaviour log-probs
build.py       tokenizer + model from a `ModelConfig`
"""
