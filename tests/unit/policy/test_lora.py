"""LoRA: adapters equal merged weights, start as the identity, and are all that trains.

The merge check is the one that matters for the actors: sampling with base + adapters must
equal sampling with W + scale * a @ b (no merge/unmerge drift), within fp32 tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.paths import HF_FIXTURES
from tunix_tasks.config import ModelConfig, config_from_dict
from tunix_tasks.learner.packing import PackedBatch
from tunix_tasks.learner.train_step import Trainer
from tunix_tasks.policy.build import base_fingerprint, build_policy
from tunix_tasks.policy.hf_checkpoint import HFCheckpoint
from tunix_tasks.policy.lora import LowRank
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.params import BASE, flat_params, load_flat_params
from tunix_tasks.policy.sampling import Sampler
from tunix_tasks.policy.spec import LoraSpec, spec_from_preset

CFG = ModelConfig(preset="custom", d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64)
SPEC = spec_from_preset(CFG, vocab_size=50)
LORA = LoraSpec(rank=4, alpha=8.0)
QWEN3 = HF_FIXTURES / "tiny-qwen3"


@nnx.jit
def _logits(model, tokens):
    t = tokens.shape[1]
    return model(tokens, jnp.broadcast_to(jnp.arange(t), tokens.shape), jnp.ones_like(tokens))


def _with_random_adapters(seed: int) -> Transformer:
    model = Transformer(SPEC, rngs=nnx.Rngs(seed), lora=LORA)
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        var.set_value(jnp.asarray(rng.normal(size=var.shape) * 0.3, jnp.float32))
    return model


def _merged(model: Transformer) -> Transformer:
    """The same function with the adapters folded into W (no adapters left)."""
    merged = Transformer(SPEC, rngs=nnx.Rngs(99))
    flat = flat_params(model)
    for path, module in model.iter_modules():
        if isinstance(module, LowRank):
            owner = "/".join(map(str, path[:-1]))
            weight = f"{owner}/w{path[-1][5:]}" if path[-2] == "attn" else f"{owner}/{path[-1][5:]}"
            flat[weight] = flat[weight] + np.asarray(module.merged_delta())
    load_flat_params(merged, {k: v for k, v in flat.items() if "lora_" not in k})
    return merged


def test_adapters_equal_merged_weights_in_forward_and_sampling():
    model = _with_random_adapters(0)
    merged = _merged(model)
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 50, size=(2, 20)), jnp.int32)
    a, b = np.asarray(_logits(model, tokens)), np.asarray(_logits(merged, tokens))
    base = Transformer(SPEC, rngs=nnx.Rngs(7))
    load_flat_params(base, flat_params(model, BASE))
    assert np.abs(a - np.asarray(_logits(base, tokens))).max() > 50 * 2e-4  # adapters act
    np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-5)

    def sample(m):
        s = Sampler(m, pad_id=0, stop_ids=(49,), batch_buckets=(2,), prompt_buckets=(16,))
        return s.sample([[1, 5, 6], [1, 7]], max_new_tokens=10, top_k=1, stop_ids=(), rng=jax.random.key(0))  # fmt: skip

    for x, y in zip(sample(model), sample(merged), strict=True):
        assert x.tokens == y.tokens


def test_fresh_adapters_leave_the_base_unchanged():
    base = Transformer(SPEC, rngs=nnx.Rngs(3))
    adapted = Transformer(SPEC, rngs=nnx.Rngs(3), lora=LORA)
    load_flat_params(adapted, flat_params(base), BASE)  # the same base weights
    tokens = jnp.asarray([[1, 5, 9, 12, 4]], jnp.int32)
    np.testing.assert_allclose(_logits(base, tokens), _logits(adapted, tokens), atol=1e-6)


def test_only_adapters_train_and_only_they_are_published(tmp_path):
    cfg = config_from_dict(
        {"store": str(tmp_path), "model": {"preset": "tiny", "lora_rank": 4}},
        ["learner.batch_rows=8", "learner.buckets=[64]"],
    )
    _, model = build_policy(cfg.model, seed=0)
    trainer = Trainer(cfg, model)
    before = flat_params(model)
    rng = np.random.default_rng(0)
    batch = PackedBatch(
        bucket_len=64,
        tokens=rng.integers(1, 100, size=(8, 64)).astype(np.int32),
        targets=rng.integers(1, 100, size=(8, 64)).astype(np.int32),
        positions=np.tile(np.arange(64, dtype=np.int32), (8, 1)),
        segment_ids=np.ones((8, 64), np.int32),
        episode_index=np.zeros((8, 64), np.int32),
        loss_mask=np.ones((8, 64), np.float32),
        behavior_logprobs=np.full((8, 64), -4.6, np.float32),
        advantages=rng.normal(size=(8, 64)).astype(np.float32),
        episode_ids=("e",),
        policy_versions=np.zeros(1, np.int64),
    )
    trainer.step(batch)
    after = flat_params(model)
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)  # the base is frozen
    assert any(k.endswith("/b") for k in changed)  # b left zero: the adapters now act
    published = trainer.flat_params()
    assert set(published) == {k for k in after if "lora_" in k}
    full = sum(v.size for v in after.values())
    assert sum(v.size for v in published.values()) < 0.2 * full


def test_checkpoint_base_with_fresh_adapters():
    ckpt = HFCheckpoint(str(QWEN3))
    spec = ckpt.spec(max_seq_len=64)
    plain = ckpt.load_model(spec)
    adapted = ckpt.load_model(spec, lora=LoraSpec(2, 4.0, ("q", "v")), seed=1)
    tokens = jnp.asarray([[5, 9, 30, 2, 7]], jnp.int32)
    np.testing.assert_allclose(_logits(plain, tokens), _logits(adapted, tokens), atol=1e-5)
    adapters = flat_params(adapted, nnx.LoRAParam)
    assert sorted({k.split("/")[-2] for k in adapters}) == ["lora_q", "lora_v"]
    cfg = ModelConfig(checkpoint=str(QWEN3), lora_rank=2)
    assert base_fingerprint(cfg, 0) == base_fingerprint(cfg, 1)  # the checkpoint, not a seed
    assert base_fingerprint(ModelConfig(), 0) != base_fingerprint(ModelConfig(), 1)


def test_actor_reloads_adapters_only_and_refuses_another_base(tmp_path):
    from tunix_tasks.actor.asynchronous.actor import Actor
    from tunix_tasks.storage.runs import write_config
    from tunix_tasks.storage.weights import WeightsPublisher

    cfg = config_from_dict(
        {"store": str(tmp_path), "run_name": "r", "model": {"preset": "tiny", "lora_rank": 2}}
    )
    store = write_config(cfg)
    actor = Actor(cfg, store, actor_id="a", incarnation="x")
    adapters = {
        k: np.full_like(v, 0.01) for k, v in flat_params(actor.engine.model, nnx.LoRAParam).items()
    }
    publisher = WeightsPublisher(store)
    wrong = {"fingerprint": "f" * 64, "uri": "another base"}
    publisher.publish(adapters, version=0, step=0, model={}, kind="adapter", base=wrong)
    assert actor.weights.poll(actor._load) is None
    assert "another base" in actor.weights.refusals() and actor.version == -1
    right = {"fingerprint": base_fingerprint(cfg.model, cfg.seed), "uri": "preset tiny"}
    publisher.publish(adapters, version=1, step=1, model={}, kind="adapter", base=right)
    assert actor.weights.poll(actor._load) is not None and actor.version == 1
    loaded = flat_params(actor.engine.model, nnx.LoRAParam)
    assert all(np.array_equal(loaded[k], adapters[k]) for k in adapters)
    assert (
        0
        < actor.weights.last_reload_bytes
        < 0.2 * 4 * sum(v.size for v in flat_params(actor.engine.model).values())
    )  # the adapters' bytes, not the model's
