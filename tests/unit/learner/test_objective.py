"""The corrections' registry: built-ins, lookup errors, and a correction of this module
chosen by its import path in the config and trained with by a real `Trainer`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_tasks.config import ConfigError, MeshConfig, config_from_dict, load_config
from tunix_tasks.config.objective import BUILTIN_CORRECTIONS
from tunix_tasks.episode import Episode
from tunix_tasks.learner.objective import (
    CorrectionOutput,
    CorrectionParams,
    LossInputs,
    get_correction,
    policy_loss,
    register_correction,
    registered,
)
from tunix_tasks.learner.objective.corrections import token_tis
from tunix_tasks.learner.packing import pack
from tunix_tasks.learner.train_step import Trainer, make_mesh
from tunix_tasks.policy.build import build_policy
from tunix_tasks.testing.shard_factory import make_episode

REPO = Path(__file__).resolve().parents[3]
HERE = "tests.unit.learner.test_objective"


@register_correction()
def zero_loss(x: LossInputs, params: CorrectionParams) -> CorrectionOutput:
    """No signal at all: the update moves nothing."""
    return CorrectionOutput(jnp.zeros_like(x.logp_new), {})


@register_correction()
def doubled_tis(x: LossInputs, params: CorrectionParams) -> CorrectionOutput:
    """`token_tis` times 2: twice its loss and gradient."""
    out = token_tis(x, params)
    return CorrectionOutput(2.0 * out.objective, out.metrics)


@register_correction(needs_proximal=True)
def proximal_gap(x: LossInputs, params: CorrectionParams) -> CorrectionOutput:
    """Reports what it was given: ``logp_new - logp_prox`` on the loss tokens."""
    assert x.logp_prox is not None
    return CorrectionOutput(x.logp_new, {"prox_gap": jnp.sum(x.mask * (x.logp_new - x.logp_prox))})


def test_builtins_are_the_configs_names_and_only_decoupled_ppo_needs_proximal():
    builtins = {name for name in registered() if ":" not in name}
    assert builtins == set(BUILTIN_CORRECTIONS)
    needs = {name for name in builtins if get_correction(name).needs_proximal}
    assert needs == {"decoupled_ppo"}
    assert get_correction(f"{zero_loss.__module__}:zero_loss").loss is zero_loss


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown correction 'sequence'.*'token_tis'.*module:f"):
        get_correction("sequence")
    with pytest.raises(ValueError, match=r"cannot import 'no_such_pkg\.mod'"):
        get_correction("no_such_pkg.mod:loss")
    with pytest.raises(ValueError, match=r"unknown correction 'tunix_tasks.episode:Episode'"):
        get_correction("tunix_tasks.episode:Episode")  # importable, registers nothing
    with pytest.raises(ValueError, match="already registered"):
        register_correction("ppo")(zero_loss)


def test_an_import_path_imports_its_module_once_looked_up(tmp_path, monkeypatch):
    (tmp_path / "my_corrections.py").write_text(
        "from tunix_tasks.learner.objective import CorrectionOutput, register_correction\n"
        "@register_correction()\n"
        "def plain(x, params):\n"
        "    return CorrectionOutput(x.advantages * x.logp_new, {})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "my_corrections:plain" not in registered()
    spec = get_correction("my_corrections:plain")
    assert spec.name == "my_corrections:plain" and not spec.needs_proximal
    logp, mu = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -2.0]])
    adv, mask = jnp.array([[1.0, 1.0]]), jnp.ones((1, 2))
    own = policy_loss(logp, mu, adv, mask, correction="my_corrections:plain")[0]
    assert own == policy_loss(logp, mu, adv, mask, correction="none")[0]


def test_policy_loss_gives_logp_prox_only_to_corrections_that_need_it():
    logp, prox = jnp.array([[-1.0, -2.0, -3.0]]), jnp.array([[-1.5, -2.0, -9.0]])
    mask, adv = jnp.array([[1.0, 1.0, 0.0]]), jnp.ones((1, 3))
    name = f"{proximal_gap.__module__}:proximal_gap"
    _, m = policy_loss(logp, logp, adv, mask, correction=name, logp_prox=prox)
    assert float(m["prox_gap"]) == pytest.approx(0.5)  # the masked-off token never counts
    _, first = policy_loss(logp, logp, adv, mask, correction=name)  # first update: sg(logp)
    assert float(first["prox_gap"]) == 0.0
    # The metrics every correction reports, filled in for one that reports none of them.
    assert float(first["ppo_clip_frac"]) == 0.0 and float(first["is_weight_mean"]) == 1.0


def test_config_accepts_an_import_path_without_importing_it_or_jax():
    script = (
        "import sys\n"
        "from tunix_tasks.config import load_config\n"
        f"cfg = load_config(None, ['learner.correction={HERE}:zero_loss'])\n"
        f"assert cfg.learner.correction == '{HERE}:zero_loss'\n"
        "print(sorted(m for m in sys.modules if m.startswith(('jax', 'tests'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
    with pytest.raises(ConfigError, match=r"'decoupled_ppo', or 'package\.module:function'"):
        load_config(None, [f"learner.correction={HERE}.zero_loss"])


# --------------------------------------------------------------------------- a real Trainer


def _trainer(correction: str) -> Trainer:
    cfg = config_from_dict(
        {
            "model": {"preset": "tiny"},
            "learner": {
                "buckets": [64],
                "batch_rows": 4,
                "learning_rate": 1e-2,
                "weight_decay": 0.0,  # else AdamW moves the params without a gradient
                "correction": correction,
            },
        }
    )
    _, model = build_policy(cfg.model, seed=cfg.seed)
    return Trainer(cfg, model, mesh=make_mesh(MeshConfig(data=1), jax.devices()[:1]))


def _batch():
    rng = np.random.default_rng(3)
    episodes = []
    for i in range(12):
        e = make_episode(rng, length=int(rng.integers(10, 30)))
        episodes.append(
            Episode(f"e{i}", e.tokens, e.loss_mask, e.behavior_logprobs, advantage=rng.normal())
        )
    return pack(episodes, buckets=(64,), batch_rows=4).batches[0]


def test_a_correction_from_the_configs_import_path_drives_the_trainer():
    batch = _batch()
    frozen = _trainer(f"{HERE}:zero_loss")
    before = frozen.flat_params()
    m = frozen.step(batch)
    assert m["loss"] == 0.0 and m["grad_norm"] == 0.0
    after = frozen.flat_params()
    assert all(np.array_equal(before[k], after[k]) for k in before)  # nothing moved

    base, doubled = _trainer("token_tis").step(batch), _trainer(f"{HERE}:doubled_tis").step(batch)
    assert base["grad_norm"] > 0
    assert doubled["pg_loss"] == pytest.approx(2 * base["pg_loss"], rel=1e-5)
    assert doubled["grad_norm"] == pytest.approx(2 * base["grad_norm"], rel=1e-4)
    assert doubled["is_weight_mean"] == pytest.approx(base["is_weight_mean"])


def test_an_unknown_import_path_fails_when_the_trainer_is_built():
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg'"):
        _trainer("no_such_pkg:loss")
