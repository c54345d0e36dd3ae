"""Tests for tunix_tasks.actor.remote: an async actor whose turns come from a completions
server. The server is the project's own (`serve`, uvicorn on loopback over the tiny
preset's batched sampler), driven by the real `RemoteEngine` over HTTP: the contract
vLLM and SGLang serve, tested against the implementation this repository can run."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
import threading
import time

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tests.paths import HF_FIXTURES
from tests.unit.actor.test_actor import (
    LOGPROB_ATOL,
    QUICK,
    TOK,
    _config,
    _forward,
    _peaky,
    _publish,
    _read_episodes,
    _recompute_logprobs,
    _Running,
)
from tunix_tasks.actor.asynchronous.actor import Actor
from tunix_tasks.actor.asynchronous.batching import BatchingPolicy
from tunix_tasks.actor.endpoint.server import EndpointServer
from tunix_tasks.actor.remote import engine as remote_engine
from tunix_tasks.actor.remote import shared_disk
from tunix_tasks.actor.remote.engine import RemoteEngine, run_weights_folder
from tunix_tasks.actor.remote.server import KEEP_ADAPTERS, Loaded, build_app, serve
from tunix_tasks.actor.remote.wire import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    WEIGHTS_FILE,
    RemoteError,
    parse_completion,
    publish_time_problem,
    served_run,
    served_version,
    supersedes,
    token_label,
)
from tunix_tasks.config import ConfigError, RunConfig
from tunix_tasks.policy.build import build_actor_sampler, build_policy, lora_spec, policy_spec
from tunix_tasks.policy.distribution import token_logprobs
from tunix_tasks.policy.hf_adapters import adapters_to_peft, peft_config
from tunix_tasks.policy.hf_checkpoint import HFCheckpoint, params_from_hf, params_to_hf
from tunix_tasks.policy.params import flat_params, load_flat_params
from tunix_tasks.storage.runs import mark_done, run_id, write_config
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import read_manifest

# ------------------------------------------------------------------ the contract, pure


def _reply(tokens=(5, 6), logprobs=(-0.5, -1.0), **choice) -> dict:
    labels = [token_label(t) for t in tokens]
    lp = {"tokens": labels, "token_logprobs": list(logprobs)}
    return {"choices": [{"logprobs": lp, "finish_reason": "stop", **choice}]}


def test_parse_completion_reads_ids_from_token_ids_or_labels():
    assert parse_completion(_reply(token_ids=[5, 6]), vocab_size=10).tokens == [5, 6]
    turn = parse_completion(_reply(), vocab_size=10)  # vLLM without return_token_ids
    assert (turn.tokens, turn.logprobs, turn.finish_reason) == ([5, 6], [-0.5, -1.0], "stop")
    # float32 rounding just above 0 is clamped, not refused
    assert parse_completion(_reply(logprobs=(1e-6, -1.0)), vocab_size=10).logprobs[0] == 0.0


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        ({"choices": [{"text": "hi"}]}, "does the server return log-probs"),
        ({"choices": []}, "does the server return log-probs"),
        (_reply(token_ids=[5]), "1 token ids and 2 log-probs"),
        (_reply(tokens=(5, 12)), r"\[12\] are outside the vocabulary \[0, 10\)"),
        (_reply(logprobs=(float("nan"), -1.0)), "not a finite number"),
        (_reply(logprobs=(-1.0, 0.5)), "log-prob is 0.5 > 0"),
        (_reply(token_ids=[5, True]), "not a list of ints"),
        (
            {"choices": [{"logprobs": {"tokens": ["hi"], "token_logprobs": [-1.0]}}]},
            "is not 'token_id:<id>'",
        ),
    ],
)
def test_parse_completion_refuses_a_reply_that_breaks_the_contract(reply, match):
    with pytest.raises(RemoteError, match=match):
        parse_completion(reply, vocab_size=10)


@pytest.mark.parametrize(
    ("reply", "version"),
    [
        ({"weight_version": "3"}, 3),  # tunix-tasks serve
        ({"weight_version": "-1"}, -1),  # its base
        ({"metadata": {"weight_version": "4"}}, 4),  # SGLang, after a push of v4
        ({"metadata": {"weight_version": "default"}}, -1),  # SGLang, no push since it started
        ({"metadata": {"weight_version": "v1.0"}}, None),  # not ours to compare: trusted
        ({"choices": []}, None),  # vLLM: says nothing, trusted
        ([], None),
    ],
)
def test_served_version_reads_what_each_server_reports(reply, version):
    assert served_version(reply) == version


def test_a_push_loads_unless_the_held_snapshot_of_its_run_supersedes_it():
    """Of the held run: a fleet mate's late push of an earlier version never loads; a
    higher version does whatever the learner's clock says, and so does a re-created run's
    lower version, published later. Another run's push always loads (the run that pushes
    last has the server); one that names no run (SGLang's callers) by version alone. A
    publish time from beyond tomorrow is no time."""
    held = ("run-a", 103.0, 3)
    for run, created_at, version, loads in [
        ("run-a", 102.0, 2, False),  # a lagging fleet mate
        ("run-a", 103.0, 3, False),  # the one held
        ("run-a", 104.0, 4, True),
        ("run-a", 90.0, 4, True),  # the learner's clock stepped back
        ("run-a", 200.0, 0, True),  # re-created under the same URI
        ("run-b", 50.0, 0, True),  # another run, even one published before
        (None, 0.0, 2, False),
        (None, 0.0, 4, True),
    ]:
        assert supersedes(run, created_at, version, held=held) is loads, (run, version)
    assert supersedes("run-a", 0.0, 0, held=(None, 0.0, -1))  # the base it started with
    assert publish_time_problem(time.time()) is None and publish_time_problem(0) is None
    for bad in (1e300, float("inf"), float("nan"), -1.0, 10**400, True, "1", None):
        assert "not a time before tomorrow" in publish_time_problem(bad), bad
    assert served_run({"weight_run": "run-1a2b3c4d", "weight_version": "3"}) == "run-1a2b3c4d"
    for reply in ({"weight_version": "3"}, {"weight_run": 5}, [], "text"):
        assert served_run(reply) is None  # vLLM, SGLang: nothing to compare


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3", "tiny-llama3"])
def test_params_to_hf_inverts_params_from_hf(name):
    """Our layout back to Hugging Face's is exact: biases (Qwen2), q/k norms (Qwen3), an
    untied output layer (Llama) land on their own names and shapes."""
    folder = HF_FIXTURES / name
    spec = HFCheckpoint(str(folder)).spec(max_seq_len=64)
    original = {}  # tiny-llama3 is sharded in two files
    for file in folder.glob("*.safetensors"):
        original |= load_file(str(file))
    ours = {k: np.asarray(v) for k, v in params_from_hf(original, spec).items()}
    back = params_to_hf(ours, spec)
    assert set(back) == set(original)
    for k, v in original.items():
        np.testing.assert_array_equal(back[k], v.astype(np.float32), err_msg=k)


# ------------------------------------------------------------------ a real server


class _Server:
    """`serve` on a loopback port in a thread (its own event loop), until `close`."""

    def __init__(self, cfg: RunConfig, *, port: int = 0, api_key: str | None = None) -> None:
        self.url = ""
        self.error: BaseException | None = None
        ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()

            def on_ready(url: str) -> None:
                self.url = url
                ready.set()

            await serve(
                cfg,
                host="127.0.0.1",
                port=port,
                api_key=api_key,
                on_ready=on_ready,
                stop=self._stop,
            )

        def run() -> None:
            try:
                asyncio.run(main())
            except BaseException as err:
                self.error = err
                ready.set()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(120), "the server did not start"
        if self.error is not None:
            raise self.error

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def close(self) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the server did not stop"


def _cfg(tmp_path, **remote) -> RunConfig:
    return _config(f"file://{tmp_path}/runs", remote=remote)


def _engine(
    cfg: RunConfig,
    url: str,
    run: str = "run-test",
    actor: str = "actor-test",
    lora=None,
    **overrides,
) -> RemoteEngine:
    chat, spec = policy_spec(cfg.model)
    remote = cfg.actor.remote.model_copy(update={"url": url, **overrides})
    return RemoteEngine(
        remote,
        chat=chat,
        spec=spec,
        max_new_tokens=cfg.actor.max_new_tokens,
        temperature=cfg.actor.temperature,
        top_k=cfg.actor.top_k,
        seed=1,
        connections=4,
        run_folder=run,
        actor_id=actor,
        lora=lora,
    )


def _digest(seed: int) -> str:
    """A snapshot's content id as a manifest holds it (here: one per `_peaky` seed)."""
    return hashlib.sha256(str(seed).encode()).hexdigest()


def _listing(folder) -> list[str]:
    """The folder's entries, but the servers' records (`.server-*`: what each holds)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".server-"))


def _pushes(server: _Server) -> int:
    """Weights pushes the server was asked for (`GET /health`)."""
    return _health(server)["weights"]["pushes"]


def _turn_logprobs(
    cfg: RunConfig, flat, context: list[int], tokens: list[int], model=None
) -> np.ndarray:
    """The log-probs of `tokens` after `context` under `flat` (or `model` as it is): one
    full forward pass."""
    if model is None:
        _, model = build_policy(cfg.model, seed=999)
        load_flat_params(model, flat)
    seq = np.asarray([context + tokens], np.int32)
    logits = _forward(model, jnp.asarray(seq), jnp.asarray([seq.shape[1]], np.int32))
    lp = np.asarray(
        token_logprobs(logits, jnp.asarray(seq), cfg.actor.temperature, cfg.actor.top_k)
    )
    return lp[0, len(context) - 1 : len(context) - 1 + len(tokens)]  # lp[t-1] scores t


async def _one_turn(engine: RemoteEngine, context: list[int]):
    async with engine:
        return await engine(context, session="ep")


def test_actor_samples_through_the_server_and_follows_new_weights(tmp_path):
    """An async actor with `actor.remote.url`: its episodes are valid shards, each turn's
    behaviour log-probs are those of the weights its version names (a full forward pass
    under them), the server follows the learner's new snapshots, and nothing compiles in
    the actor."""
    server = _Server(_cfg(tmp_path))
    try:
        cfg = _cfg(tmp_path, url=server.url)
        store = write_config(cfg)
        v0, v1 = _peaky(123, cfg), _peaky(456, cfg)
        _publish(store, cfg, v0, version=0)
        actor = Actor(cfg, store, actor_id="actor-remote")
        assert isinstance(actor.engine, RemoteEngine)
        # named for this incarnation of the run (a re-created one gets another id)
        run_folder = run_weights_folder(cfg.run_name, cfg.run_uri, run_id(store))
        assert run_id(store) and actor.engine.weights_dir.name == run_folder
        run = _Running(actor)
        run.episodes_at_least(8)
        _publish(store, cfg, v1, version=1)
        run.until(lambda: actor.version == 1, "v1 pushed to the server")
        seen = actor.stats.episodes
        run.episodes_at_least(seen + 12)
        mark_done(store, "test finished")
        summary = run.join()
    finally:
        server.close()

    assert summary["compile_count"] == 0 and summary["last_version"] == 1
    # The folder the server loaded is named by the snapshot's content (its manifest's sha256).
    assert _listing(actor.engine.weights_dir) == [f"v1-{read_manifest(store, 1).sha256[:16]}"]
    episodes = _read_episodes(open_store(cfg.run_uri))
    assert {e.env for e in episodes} == {QUICK}
    assert all(e.tokens[0] == TOK.bos_id and e.loss_mask.sum() > 0 for e in episodes)
    fresh = [e for e in episodes if e.policy_version == 1]
    assert len(fresh) >= 4
    # An episode tagged v1 asked for every turn after the server held v1.
    recorded, recomputed = _recompute_logprobs(cfg, v1, fresh)
    np.testing.assert_allclose(recorded, recomputed, atol=LOGPROB_ATOL, rtol=0)
    _, under_v0 = _recompute_logprobs(cfg, v0, fresh)
    assert np.abs(recorded - under_v0).max() > 1e-2  # the check can tell weights apart


def test_a_restarted_server_gets_the_weights_again(tmp_path):
    """The server restarts (back to its base weights): the engine notices from the
    reply's weight version, pushes the weights it pushed before, and asks again, so no
    turn is recorded from the wrong weights. Eight turns that notice at once push once
    (vLLM and SGLang would load each push), after each restart."""
    cfg = _cfg(tmp_path)
    v1 = _peaky(456, cfg)
    context = [TOK.bos_id, *TOK.encode("q3")]
    server = _Server(cfg)
    port = server.port
    engine = _engine(cfg, server.url)
    try:
        engine.update_params(v1, version=1)
        tokens, logprobs, version = asyncio.run(_one_turn(engine, context))
        assert version == 1
        np.testing.assert_allclose(
            logprobs, _turn_logprobs(cfg, v1, context, tokens), atol=LOGPROB_ATOL
        )
        server.close()
        server = _Server(cfg, port=port)  # fresh: the base weights, version -1

        async def turns() -> list:
            async with engine:
                return await asyncio.gather(*(engine(context, session=i) for i in range(8)))

        for restart in range(2):  # each restart restored once
            for tokens, logprobs, version in asyncio.run(turns()):
                assert version == 1
                np.testing.assert_allclose(
                    logprobs, _turn_logprobs(cfg, v1, context, tokens), atol=LOGPROB_ATOL
                )
            assert _pushes(server) == 1
            if restart == 0:
                server.close()
                server = _Server(cfg, port=port)
    finally:
        server.close()


def test_weight_pushes_are_checked_and_never_go_back(tmp_path):
    """A folder the model cannot load is refused (400, success false) with the reason and
    the weights stay; a version at or below the loaded one is acknowledged without a
    load; a snapshot of the wrong shapes never leaves the actor (ValueError: the weights
    client refuses that version)."""
    cfg = _cfg(tmp_path)
    server = _Server(cfg)
    engine = _engine(cfg, server.url)
    try:
        engine.update_params(_peaky(1, cfg), version=2)
        other = tmp_path / "qwen3"
        other.mkdir()
        qwen3 = load_file(str(HF_FIXTURES / "tiny-qwen3" / WEIGHTS_FILE))
        save_file(qwen3, str(other / WEIGHTS_FILE))
        with httpx.Client(base_url=server.url, timeout=60) as http:
            push = {"model_path": str(other), "weight_version": "3"}
            r = http.post("/update_weights_from_disk", json=push)
            assert r.status_code == 400 and r.json()["success"] is False
            assert "shape" in r.json()["message"] or "missing" in r.json()["message"]
            push = {"model_path": "/nowhere", "weight_version": "1"}
            r = http.post("/update_weights_from_disk", json=push)
            assert r.json() == {
                "success": True,
                "message": "already at v2",
                "weight_version": "2",
                "weight_run": "run-test",
            }
            for field, value, reason in [
                ("created_at", 1e300, "not a time before tomorrow"),
                ("created_at", True, "not a time before tomorrow"),
                ("weight_run", "run\nforged log line", "printable ASCII"),
                ("weight_run", "", "printable ASCII"),
                ("weight_run", 5, "printable ASCII"),
            ]:
                r = http.post("/update_weights_from_disk", json=push | {field: value})
                assert r.status_code == 400 and reason in r.json()["message"], (field, value)
            r = http.post("/v1/completions", json={"prompt": "text", "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            r = http.post("/v1/completions", json={"prompt": [TOK.vocab_size], "max_tokens": 2})
            assert r.status_code == 400 and "outside" in r.json()["error"]["message"]
        bad = dict(_peaky(1, cfg))
        bad["embed"] = bad["embed"][:, :-1]
        with pytest.raises(ValueError, match="embed"):
            engine.update_params(bad, version=4)
        assert engine.version == 2
        _, _, version = asyncio.run(_one_turn(engine, [TOK.bos_id]))
        assert version == 2
    finally:
        server.close()


def _refused(r: httpx.Response, param: str | None = None) -> str:
    """The message of a 400 in OpenAI's error body, none of Python's internals in it."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param is None or err["param"] == param, err
    for internal in ("Traceback", "invalid literal", "set_int_max_str_digits", "recursion"):
        assert internal not in r.text, r.text
    return err["message"]


def test_a_server_kept_across_runs_serves_the_run_that_published_last(tmp_path):
    """`tunix-tasks serve` kept running from one run to the next: a run re-created under
    the same URI (versions from 0 again, once acknowledged without a load: its turns drawn
    by the old run's weights) loads, a fleet mate's late push of an earlier one never
    moves it back, and the run that pushes last has it (a run resumed after another used
    it included). An actor of the run it replaced stops at its next turn with an error
    naming both runs, and not the URL's credentials, instead of sampling the other's
    weights. A push that names no run (SGLang's callers) goes by version."""
    cfg = _cfg(tmp_path)
    context = [TOK.bos_id, *TOK.encode("q3")]
    server = _Server(cfg)

    def loads() -> int:
        return _health(server)["weights"]["loads"]

    def drawn_by(engine: RemoteEngine, seed: int, tag: int) -> None:
        tokens, logprobs, version = asyncio.run(_one_turn(engine, context))
        assert version == tag
        np.testing.assert_allclose(
            logprobs, _turn_logprobs(cfg, _peaky(seed, cfg), context, tokens), atol=LOGPROB_ATOL
        )

    try:
        first = _engine(cfg, server.url, run="run-a")
        first.update_params(_peaky(3, cfg), version=3, created_at=103.0)
        again = _engine(cfg, server.url.replace("//", "//user:secret@"), run="run-a")
        again.update_params(_peaky(9, cfg), version=0, created_at=200.0)  # re-created
        drawn_by(again, 9, 0)
        again.update_params(_peaky(8, cfg), version=1, created_at=201.0)
        mate = _engine(cfg, server.url, run="run-a", actor="actor-mate")
        mate.update_params(_peaky(9, cfg), version=0, created_at=200.0)  # late: no load
        assert loads() == 3 and _health(server)["weight_run"] == "run-a"
        drawn_by(mate, 8, 0)  # drawn by v1, tagged with the mate's own v0

        other = _engine(cfg, server.url, run="run-b")
        other.update_params(_peaky(5, cfg), version=0, created_at=300.0)
        drawn_by(other, 5, 0)
        with pytest.raises(RemoteError, match=r"serves run 'run-b'.*this run's \('run-a'\)") as e:
            asyncio.run(_one_turn(again, context))
        assert "secret" not in str(e.value) and f"127.0.0.1:{server.port}" in str(e.value)
        again.update_params(_peaky(7, cfg), version=2, created_at=250.0)  # run a resumed
        assert loads() == 5
        with pytest.raises(RemoteError, match="serves run 'run-a'"):
            asyncio.run(_one_turn(other, context))
        drawn_by(again, 7, 2)
        again.update_params(_peaky(6, cfg), version=3, created_at=240.0)  # its clock went back
        drawn_by(again, 6, 3)

        with httpx.Client(base_url=server.url, timeout=60) as http:
            folder = str(again._pushed[1])
            for version, loaded in (("2", False), ("4", True)):
                body = {"model_path": folder, "weight_version": version}
                r = http.post("/update_weights_from_disk", json=body)
                assert r.json()["message"].startswith("loaded" if loaded else "already at v3")
        assert _health(server)["weight_version"] == "4"
    finally:
        server.close()


def test_a_turn_sampled_while_another_runs_weights_loaded_is_refused(tmp_path):
    """A turn decoding while another run's push loads may hold tokens of both runs'
    weights (and of a run switched away from and back, which no reply could name): a
    409, never a reply its actor would record: the engine stops on it. A load of the
    same run's next version mid-turn is a turn of the older version, as before."""
    cfg = _cfg(tmp_path)
    chat, sampler = build_actor_sampler(cfg)
    gate, held, release = threading.Event(), threading.Event(), threading.Event()

    def hold_the_engine() -> None:  # before a step, on the engine thread
        if gate.is_set():
            gate.clear()
            held.set()
            assert release.wait(60)

    async def main() -> list[int]:
        # Segments of 16 tokens: a turn of 40 spans three steps, a load between them.
        policy = BatchingPolicy(sampler, max_new_tokens=40, before_batch=hold_the_engine)
        spec = sampler.model.spec
        app = build_app(policy, loaded=Loaded(), chat=chat, spec=spec, model_name="m")
        async with (
            policy,
            EndpointServer(app, host="127.0.0.1", port=0) as server,
            httpx.AsyncClient(base_url=server.base_url, timeout=60) as http,
        ):

            async def push(run: str, version: int, created_at: float) -> None:
                folder = _weights_folder(tmp_path / f"{run}-{version}", cfg)
                body = {"model_path": folder, "weight_version": str(version)}
                body |= {"weight_run": run, "created_at": created_at}
                r = await http.post("/update_weights_from_disk", json=body)
                assert r.json()["message"].startswith("loaded"), r.text

            async def turn_across(load, ask=None):  # `ask`: a turn other than by hand
                gate.set()
                body = {"prompt": [TOK.bos_id], "max_tokens": 40, "temperature": 0.0}
                asked = asyncio.create_task(ask or http.post("/v1/completions", json=body))
                assert await asyncio.to_thread(held.wait, 60)  # admitted, not stepped
                held.clear()
                loading = asyncio.create_task(load)
                for _ in range(6000):  # the load waits for the engine thread
                    if policy._calls:
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise AssertionError("the push never reached the engine thread")
                release.set()
                await loading
                release.clear()
                return await asked

            await push("run-a", 0, 100.0)
            r = await turn_across(push("run-a", 1, 101.0))
            codes = [r.status_code]
            assert r.json()["weight_version"] == "0"  # the oldest that drew it
            r = await turn_across(push("run-b", 0, 200.0))
            assert "another run's weights were loaded" in r.json()["error"]["message"], r.text

            # The engine of run b stops on it, saying why and what to do.
            engine = _engine(cfg, server.base_url, run="run-b")
            engine.max_new_tokens, engine.temperature = 40, 0.0
            flat = _peaky(1, cfg)
            await asyncio.to_thread(engine.update_params, flat, version=1, created_at=201.0)
            async with engine:
                with pytest.raises(RemoteError, match="loaded another run's weights while"):
                    await turn_across(push("run-c", 0, 300.0), engine([TOK.bos_id]))
            return [*codes, r.status_code]

    assert asyncio.run(main()) == [200, 409]


def test_requests_the_sampler_cannot_run_are_refused_and_it_keeps_serving(tmp_path):
    """Settings the engine thread cannot lay out (int32) or that give NaN log-probs are a
    400 naming the bound, never a failed engine (every later turn a 500 while /health
    said ok); so are bodies the JSON parser cannot read. A `max_tokens` past the context
    is cut to it, as the sampler stops there."""
    cfg = _cfg(tmp_path)
    server = _Server(cfg)
    turn = {"prompt": [TOK.bos_id], "max_tokens": 2}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            msg = _refused(http.post("/v1/completions", json=turn | {"max_tokens": 10**12}))
            assert "max_tokens" in msg and "2147483647" in msg
            msg = _refused(http.post("/v1/completions", json=turn | {"top_k": 10**12}), "top_k")
            assert f"vocabulary size ({TOK.vocab_size})" in msg
            for t in (1e-46, 1e39, float("inf")):
                raw = json.dumps(turn | {"temperature": t}).encode()  # Infinity: Python's JSON
                msg = _refused(http.post("/v1/completions", content=raw), "temperature")
                assert "0 (greedy) or in [1e-06, 1e+06]" in msg
            msg = _refused(http.post("/v1/completions", content=b"[" * 100_000))
            assert "nested too deeply" in msg
            raw = b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}"
            assert "more than 4300 digits" in _refused(http.post("/v1/completions", content=raw))
            r = http.post("/v1/completions", json=turn | {"max_tokens": 2**31 - 1})
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"][0]["token_ids"]) <= cfg.model.max_seq_len
            r = http.post("/v1/completions", json=turn)
            assert r.status_code == 200 and _health(server)["status"] == "ok"
    finally:
        server.close()


def test_health_reports_an_engine_that_stopped(tmp_path):
    """An engine thread that stopped (here: its weights reload raised) fails every turn
    from then on: `/health` says so (503, the reason) and turns are a 503 saying what to
    do, not a 500 each."""
    cfg = _cfg(tmp_path)
    chat, sampler = build_actor_sampler(cfg)

    def reload() -> None:
        raise RuntimeError("the reload found no weights")

    async def run() -> None:
        policy = BatchingPolicy(sampler, max_new_tokens=2, before_batch=reload)
        app = build_app(policy, loaded=Loaded(), chat=chat, spec=sampler.model.spec, model_name="m")
        async with (
            policy,
            EndpointServer(app, host="127.0.0.1", port=0) as server,
            httpx.AsyncClient(base_url=server.base_url, timeout=60) as http,
        ):
            assert (await http.get("/health")).json()["status"] == "ok"
            turn = {"prompt": [TOK.bos_id]}
            assert (await http.post("/v1/completions", json=turn)).status_code == 500
            r = await http.post("/v1/completions", json=turn)
            assert r.status_code == 503 and "restart the server" in r.json()["error"]["message"]
            r = await http.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "failed"
            assert r.json()["error"] == "RuntimeError: the reload found no weights"

    asyncio.run(run())


def _weights_folder(folder, cfg: RunConfig, **changed: np.ndarray) -> str:
    """A checkpoint folder as the engine writes it (`_peaky(1)`'s), tensors `changed`."""
    folder.mkdir(parents=True)
    tensors = params_to_hf(_peaky(1, cfg), policy_spec(cfg.model)[1]) | changed
    save_file(tensors, str(folder / WEIGHTS_FILE))
    return str(folder)


def test_weights_folders_and_versions_are_checked_before_anything_loads(tmp_path):
    """A weights push is refused (400, the reason, nothing loaded) for a version that is
    not ASCII digits below 10**18 (one loaded would freeze the weights: every later push
    "already at" it), a weights file that is not a regular file (a FIFO hung the load and
    SIGTERM; /dev/zero filled the memory), one larger than the model's tensors can take,
    a header nested too deeply, or a NaN; a later push loads."""
    cfg = _cfg(tmp_path)
    server = _Server(cfg)
    good = _weights_folder(tmp_path / "good", cfg)
    spec, embed = policy_spec(cfg.model)[1], "model.embed_tokens.weight"
    shape = (spec.vocab_size, spec.d_model)
    nan = _weights_folder(tmp_path / "nan", cfg, **{embed: np.full(shape, np.nan, np.float32)})
    odd = {name: tmp_path / name for name in ("fifo", "zero", "folder", "huge", "deep")}
    for folder in odd.values():
        folder.mkdir()
    os.mkfifo(odd["fifo"] / WEIGHTS_FILE)
    os.symlink("/dev/zero", odd["zero"] / WEIGHTS_FILE)
    (odd["folder"] / WEIGHTS_FILE).mkdir()
    with open(odd["huge"] / WEIGHTS_FILE, "wb") as f:
        f.truncate(1 << 40)  # sparse: 1 TiB on no disk
    header = b"[" * 100_000 + b"]" * 100_000
    (odd["deep"] / WEIGHTS_FILE).write_bytes(len(header).to_bytes(8, "little") + header)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:

            def push(path: str, version) -> httpx.Response:
                body = {"model_path": path, "weight_version": version}
                return http.post("/update_weights_from_disk", json=body)

            for version in (10**30, "9" * 5000, "²", "+3", " 3", True, 1.5, -1):
                r = push(good, version)
                assert r.status_code == 400, (version, r.text)
                assert "at most 18 digits" in r.json()["message"]
                assert "invalid literal" not in r.text and "4300" not in r.text
            reasons = {
                "fifo": "not a regular file",
                "zero": "not a regular file",
                "folder": "not a regular file",
                "huge": "over the limit",
                "deep": "nested too deeply",
            }
            for name, reason in reasons.items():
                r = push(str(odd[name]), "5")
                assert r.status_code == 400 and reason in r.json()["message"], (name, r.text)
            r = push(nan, "5")
            assert r.status_code == 400 and f"tensor '{embed}' has" in r.json()["message"]
            assert r.json()["message"].endswith(f"NaN/Inf of {np.prod(shape)} values: not loaded")
            assert _health(server)["weights"] == {"pushes": 6, "loads": 0}
            r = http.post("/v1/completions", json={"prompt": [TOK.bos_id], "max_tokens": 2})
            assert r.status_code == 200 and r.json()["weight_version"] == "-1"
            assert push(good, str(10**18 - 1)).json()["message"] == f"loaded {good}"
    finally:
        server.close()


def test_runs_sharing_a_weights_dir_keep_to_their_own_folders(tmp_path):
    """Two runs of one name in two stores, each with an `actor-0`, push through one shared
    `weights_dir`: neither run's push overwrites, nor its clean-up deletes, the folder of
    the other, which that run's server may be loading."""
    shared = tmp_path / "shared"
    cfg = _cfg(tmp_path, weights_dir=str(shared))
    runs = [run_weights_folder("run", f"gs://bucket-{b}/run") for b in "ab"]
    assert runs[0] != runs[1] and all(r.startswith("run-") for r in runs)
    server = _Server(cfg)
    try:
        a, b = (_engine(cfg, server.url, run=r, actor="actor-0") for r in runs)
        a.update_params(_peaky(1, cfg), version=1, digest=_digest(1))
        b.update_params(_peaky(2, cfg), version=2, digest=_digest(2))  # the server: v2
        a.update_params(_peaky(3, cfg), version=4, digest=_digest(3))
    finally:
        server.close()
    # Run a's v1 is two versions behind its v4: gone. Run b's v2 stays.
    assert _listing(shared / runs[0]) == [f"v4-{_digest(3)[:16]}"]
    assert _listing(shared / runs[1]) == [f"v2-{_digest(2)[:16]}"]
    assert (shared / runs[1] / f"v2-{_digest(2)[:16]}" / WEIGHTS_FILE).stat().st_size > 0


def test_a_fleet_on_one_server_writes_each_version_once(tmp_path):
    """Three actors of one run push each version through one shared `weights_dir`: one
    writes the folder (the first to claim it), the others wait for it and push the same
    folder; the folder from two versions back goes once the server holds the new one; a
    run re-created under the same URI (versions from 0 again, other content) never takes
    the old run's folder of that version."""
    shared = tmp_path / "shared"
    cfg = _cfg(tmp_path, weights_dir=str(shared))
    run = run_weights_folder(cfg.run_name, cfg.run_uri)
    server = _Server(cfg)
    try:
        fleet = [_engine(cfg, server.url, run=run, actor=f"actor-{i}") for i in range(3)]
        flats = {v: _peaky(v, cfg) for v in (1, 2, 3)}
        for v in (1, 2, 3):  # all three at once, as actors polling the same LATEST
            _all_at_once(
                fleet, lambda e, v=v: e.update_params(flats[v], version=v, digest=_digest(v))
            )
            assert sum(e.folders_written for e in fleet) == v, f"v{v} written more than once"
            pushed = {e._pushed for e in fleet}  # (version, folder) each engine holds
            assert len(pushed) == 1 and (next(iter(pushed))[1] / WEIGHTS_FILE).is_file()
            # One push a version reached the server: the others found it in its record.
            assert _pushes(server) == v and sum(e.loads_skipped for e in fleet) == 2 * v
        assert _listing(shared / run) == [f"v2-{_digest(2)[:16]}", f"v3-{_digest(3)[:16]}"]
        _, _, version = asyncio.run(_one_turn(fleet[0], [TOK.bos_id]))
        assert version == 3

        server.close()
        server = _Server(cfg)  # the run re-created: its own v1, another content
        again = _engine(cfg, server.url, run=run, actor="actor-0")
        again.update_params(_peaky(9, cfg), version=1, digest=_digest(9))
        assert again.folders_written == 1
        tokens, logprobs, version = asyncio.run(_one_turn(again, [TOK.bos_id]))
        assert version == 1
        np.testing.assert_allclose(
            logprobs, _turn_logprobs(cfg, _peaky(9, cfg), [TOK.bos_id], tokens), atol=LOGPROB_ATOL
        )
    finally:
        server.close()


def test_a_lagging_actor_never_moves_the_servers_weights_back(tmp_path):
    """An actor two versions behind its fleet pushes what it has: the server's record says
    an actor of the run had it load a snapshot published later, so nothing is written or
    pushed (vLLM and SGLang would load it: the weights would go back) and the actor's
    turns are tagged with its own, older, version (the staleness bound errs on the safe
    side). When the server restarts, the lagging actor restores the later snapshot, not its
    own. A run re-created under the same URI (a lower version, published later), an
    actor started after the record was written (its server may have restarted with it)
    and an unreadable record are pushed."""
    cfg = _cfg(tmp_path, weights_dir=str(tmp_path / "shared"))
    run = tmp_path / "shared" / "run"
    server = _Server(cfg)
    port = server.port
    try:
        ahead, behind = (_engine(cfg, server.url, run="run", actor=f"actor-{i}") for i in (0, 1))
        for v in (1, 2, 3):
            ahead.update_params(_peaky(v, cfg), version=v, digest=_digest(v), created_at=100.0 + v)
        behind.update_params(_peaky(1, cfg), version=1, digest=_digest(1), created_at=101.0)
        assert _pushes(server) == 3 and behind.loads_skipped == 1 and behind.version == 1
        assert behind.folders_written == 0 and not (run / f"v1-{_digest(1)[:16]}").exists()
        tokens, logprobs, version = asyncio.run(_one_turn(behind, [TOK.bos_id]))
        assert version == 1  # drawn by v3, tagged as the older v1
        np.testing.assert_allclose(
            logprobs, _turn_logprobs(cfg, _peaky(3, cfg), [TOK.bos_id], tokens), atol=LOGPROB_ATOL
        )
        server.close()
        server = _Server(cfg, port=port)  # back to its base weights
        tokens, logprobs, version = asyncio.run(_one_turn(behind, [TOK.bos_id]))
        assert version == 1 and _health(server)["weight_version"] == "3"
        np.testing.assert_allclose(
            logprobs, _turn_logprobs(cfg, _peaky(3, cfg), [TOK.bos_id], tokens), atol=LOGPROB_ATOL
        )
        # The restore named v3's publish time: a mate with a record of its own, late with
        # v2 (published before v3, after the lagging actor's v1), moves nothing back.
        mate = _engine(cfg, server.url, run="run", actor="actor-2", weights_dir="")
        mate.update_params(_peaky(2, cfg), version=2, digest=_digest(2), created_at=102.0)
        assert _health(server)["weight_version"] == "3"

        pushed = _pushes(server)  # 2: the restore, the mate's
        again = _engine(cfg, server.url, run="run", actor="actor-0")  # the run re-created
        again.update_params(_peaky(9, cfg), version=1, digest=_digest(9), created_at=200.0)
        assert _pushes(server) == pushed + 1 and again.loads_skipped == 0
        tokens, logprobs, version = asyncio.run(_one_turn(again, [TOK.bos_id]))
        assert version == 1  # loaded: published after the v3 the server held
        np.testing.assert_allclose(
            logprobs, _turn_logprobs(cfg, _peaky(9, cfg), [TOK.bos_id], tokens), atol=LOGPROB_ATOL
        )
        restarted = _engine(cfg, server.url, run="run", actor="actor-1")  # after the record
        restarted.update_params(_peaky(9, cfg), version=1, digest=_digest(9), created_at=200.0)
        assert _pushes(server) == pushed + 2
        restarted.update_params(_peaky(9, cfg), version=1, digest=_digest(9), created_at=200.0)
        assert _pushes(server) == pushed + 2 and restarted.loads_skipped == 1
        for record in run.glob(".server-*.json"):
            record.write_text("{not json")  # a torn or foreign record: push
        again.update_params(_peaky(9, cfg), version=1, digest=_digest(9), created_at=200.0)
        assert _pushes(server) == pushed + 3
    finally:
        server.close()


def test_a_stale_claim_is_taken_over_once_and_a_live_one_never(tmp_path):
    """Two waiters found the same claim stale: the first moves it aside and claims; the
    second, late, moves aside the first's fresh claim, sees it is fresh and puts it back.
    A holder that lost its claim (stalled past the stale limit) does not remove the new
    holder's. The same URL on a loopback address names each machine's own server."""
    claim = tmp_path / ".v1-x.claim"
    claim.write_bytes(b"dead")
    stale = time.time() - shared_disk.CLAIM_STALE_S - 5
    os.utime(claim, (stale, stale))
    with shared_disk.claimed(claim, ready=lambda: False, timeout_s=5) as mine:
        assert mine
        token = claim.read_bytes()
        assert token != b"dead"
        shared_disk._take_over(claim, b"late")  # the late waiter
        assert claim.read_bytes() == token and sorted(p.name for p in tmp_path.iterdir()) == [
            claim.name
        ]
        claim.write_bytes(b"another")  # lost it meanwhile
    assert claim.read_bytes() == b"another"

    def key(url: str, host: str) -> str:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(shared_disk.socket, "gethostname", lambda: host)
            return shared_disk.ServerRecord(tmp_path, url).path.name

    for url in ("http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000"):
        assert key(url, "host-a") != key(url, "host-b")
    assert key("http://inference:8000", "host-a") == key("http://inference:8000", "host-b")


def test_a_stale_claim_that_is_a_folder_is_removed_not_waited_on(tmp_path):
    """Claims are files: a folder at a claim's name (no holder's), once stale, is removed
    and the waiter claims; it crashed the waiter (IsADirectoryError) and stayed aside."""
    claim = tmp_path / ".v3-x.claim"
    claim.mkdir()
    (claim / "inside").write_text("x")
    stale = time.time() - shared_disk.CLAIM_STALE_S - 5
    os.utime(claim, (stale, stale))
    with shared_disk.claimed(claim, ready=lambda: False, timeout_s=5) as mine:
        assert mine and claim.is_file()
    assert list(tmp_path.iterdir()) == []


def _bad_record(path, kind: str) -> None:
    """A server record the engine would never write, of `kind`."""
    good = {"version": 3, "digest": _digest(3), "created_at": 100.0}
    texts = {
        "escaping digest": good | {"digest": "/../../../evil00"},
        "escaping, far future": good | {"digest": "/../../../evil00", "created_at": 1e300},
        "short digest": good | {"digest": _digest(3)[:16]},
        "far future": good | {"created_at": 1e300},
        "negative time": good | {"created_at": -1.0},
        "bool version": good | {"version": True},
        "huge version": good | {"version": 2**60},
        "a list": [good],
    }
    if kind in texts:
        path.write_text(json.dumps(texts[kind]))
    elif kind == "Infinity":  # Python's JSON reads it
        path.write_text(json.dumps(good).replace("100.0", "Infinity"))
    elif kind == "deep":
        path.write_bytes(b"[" * 100_000)
    elif kind == "big":
        path.write_text(json.dumps(good | {"pad": "x" * (1 << 16)}))
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()


RECORD_KINDS = [
    "escaping digest",
    "escaping, far future",
    "short digest",
    "far future",
    "negative time",
    "bool version",
    "huge version",
    "a list",
    "Infinity",
    "deep",
    "big",
    "fifo",
    "folder",
]


@pytest.mark.parametrize("kind", RECORD_KINDS)
def test_a_record_the_engine_would_not_write_is_no_record(tmp_path, caplog, kind):
    """Read every time an actor pushes (and every poll while it waits): a record of a
    field the engine would not write, or that is not a small regular file, is no record
    (the actor pushes), logged once; it never hangs, raises, or names a folder outside
    the run's."""
    record = shared_disk.ServerRecord(tmp_path, "http://inference:8000")
    record.write(version=3, digest=_digest(3), created_at=100.0, writer="a", previous=(2, "f" * 64))
    assert record.read()["digest"] == _digest(3) and record.read()["previous"] == (2, "f" * 64)
    for previous in (2, {"version": 2, "digest": "/../evil00"}):  # older engines', poisoned
        held = json.loads(record.path.read_text()) | {"previous": previous}
        record.path.write_text(json.dumps(held))
        assert record.read()["previous"] is None  # nothing to unload, still a record
    record.path.unlink()
    _bad_record(record.path, kind)
    assert record.read() is None and record.read() is None
    assert len([r for r in caplog.records if "not a server record" in r.getMessage()]) == 1


def test_a_poisoned_record_neither_stops_the_pushes_nor_sends_the_server_elsewhere(tmp_path):
    """A record naming a snapshot published in the far future made every actor of the
    run lag behind it (no push again), and its digest named a folder outside the run's,
    which a restore pushed to the server. Now it is no record: the actor pushes, and
    after a server restart restores its own snapshot."""
    cfg = _cfg(tmp_path, weights_dir=str(tmp_path / "shared"))
    run = tmp_path / "shared" / "run"
    (run / "v9-").mkdir(parents=True)  # what the escaping path goes through
    _weights_folder(tmp_path / "evil00", cfg)  # where it leads
    server = _Server(cfg)
    port = server.port
    try:
        engine = _engine(cfg, server.url, run="run")
        kinds = ("escaping, far future", "Infinity", "far future", "fifo", "folder")
        for v, kind in enumerate(kinds, start=1):
            record = engine._record.path
            record.unlink(missing_ok=True)  # the record of the push before
            _bad_record(record, kind)
            engine.update_params(_peaky(v, cfg), version=v, digest=_digest(v), created_at=100.0 + v)
            assert _pushes(server) == v and engine.loads_skipped == 0, kind
        record.unlink()
        _bad_record(record, "escaping, far future")
        server.close()
        server = _Server(cfg, port=port)  # back to its base weights: the turn restores
        tokens, logprobs, version = asyncio.run(_one_turn(engine, [TOK.bos_id]))
        assert version == 5 and _health(server)["weight_version"] == "5"
        np.testing.assert_allclose(
            logprobs, _turn_logprobs(cfg, _peaky(5, cfg), [TOK.bos_id], tokens), atol=LOGPROB_ATOL
        )
        with pytest.raises(ValueError, match="not a sha256"):
            engine.update_params(_peaky(6, cfg), version=6, digest="/../../../evil00")
    finally:
        server.close()


def _health(server: _Server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=30).json()


def _lora_cfg(tmp_path, **remote) -> RunConfig:
    cfg = _cfg(tmp_path, **remote)
    model = cfg.model.model_copy(update={"lora_rank": 4, "lora_alpha": 8.0})
    return cfg.model_copy(update={"model": model})


def _adapters(cfg: RunConfig, seed: int) -> dict[str, np.ndarray]:
    """Adapters far from the identity (B is zero in a fresh one), as a LoRA run publishes."""
    _, model = build_policy(cfg.model, seed=seed)
    return {k: v + 0.5 for k, v in flat_params(model, nnx.LoRAParam).items()}


def _lora_turn_logprobs(cfg: RunConfig, adapters, context, tokens) -> np.ndarray:
    """Log-probs of `tokens` under the server's base (its seed's) with `adapters` on."""
    _, model = build_policy(cfg.model, seed=cfg.seed)
    load_flat_params(model, adapters, nnx.LoRAParam)
    return _turn_logprobs(cfg, flat_params(model), context, tokens, model=model)


def test_a_lora_run_loads_its_adapters_by_name(tmp_path):
    """A LoRA run's snapshots are adapters: the engine writes each as a PEFT folder, has
    the server load it as `<run>-<digest>-v<N>` (vLLM's route) and names it in its turns, whose
    log-probs are those of the base with that adapter. A fleet of three loads each once;
    an actor a version behind names the later adapter (tagged with its own version);
    adapters from before the one behind are unloaded, and a mate still naming one has the
    newest named after its turn's 404; after a server restart the 404 has the adapter
    loaded again."""
    cfg = _lora_cfg(tmp_path, weights_dir=str(tmp_path / "shared"))
    lora = lora_spec(cfg.model)
    server = _Server(cfg)
    port = server.port
    context = [TOK.bos_id, *TOK.encode("q3")]
    try:
        fleet = [
            _engine(cfg, server.url, run="run", actor=f"actor-{i}", lora=lora) for i in range(3)
        ]
        ad = {v: _adapters(cfg, v) for v in (1, 2, 3)}

        def push(engine: RemoteEngine, v: int) -> None:
            engine.update_params(
                ad[v], version=v, only=nnx.LoRAParam, digest=_digest(v), created_at=100.0 + v
            )

        _all_at_once(fleet, lambda e: push(e, 1))
        assert _pushes(server) == 1 and sum(e.folders_written for e in fleet) == 1
        named = {v: f"run-{_digest(v)[:8]}-v{v}" for v in (1, 2, 3)}  # apart from a re-created
        assert {e._pushed[2] for e in fleet} == {named[1]}  # run's, which vLLM keeps serving
        assert sorted((tmp_path / "shared/run" / f"v1-{_digest(1)[:16]}").iterdir()) == [
            tmp_path / "shared/run" / f"v1-{_digest(1)[:16]}" / n
            for n in ("adapter_config.json", "adapter_model.safetensors")
        ]
        tokens, logprobs, version = asyncio.run(_one_turn(fleet[0], context))
        assert version == 1
        np.testing.assert_allclose(
            logprobs, _lora_turn_logprobs(cfg, ad[1], context, tokens), atol=LOGPROB_ATOL
        )
        ahead, behind = fleet[0], fleet[1]
        push(ahead, 2)
        push(ahead, 3)
        assert _health(server)["weight_version"] == "3"
        models = {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert {named[2], named[3]} <= models and named[1] not in models  # v1 unloaded
        # A mate still on v1: its adapter unloaded and its folder gone, its turn's 404 has
        # it name the newest adapter from now on (its tag stays v1).
        late = fleet[2]
        tokens, logprobs, version = asyncio.run(_one_turn(late, context))
        assert version == 1 and late._pushed[2] == named[3]
        np.testing.assert_allclose(
            logprobs, _lora_turn_logprobs(cfg, ad[3], context, tokens), atol=LOGPROB_ATOL
        )
        push(behind, 2)  # a version behind: the later adapter, no write, no push
        # (4 pushes: v1, v2, v3, and the late mate's of v3, answered "already loaded")
        assert behind._pushed[2] == named[3] and behind.version == 2 and _pushes(server) == 4
        tokens, logprobs, version = asyncio.run(_one_turn(behind, context))
        assert version == 2
        np.testing.assert_allclose(
            logprobs, _lora_turn_logprobs(cfg, ad[3], context, tokens), atol=LOGPROB_ATOL
        )

        server.close()
        server = _Server(cfg, port=port)  # holds no adapter: the turn is a 404
        tokens, logprobs, version = asyncio.run(_one_turn(late, context))
        assert version == 1 and _health(server)["weight_version"] == "3"
        np.testing.assert_allclose(
            logprobs, _lora_turn_logprobs(cfg, ad[3], context, tokens), atol=LOGPROB_ATOL
        )
        # The restore named v3's publish time, not the late mate's own v1's: another mate
        # with a record of its own, late with v2, moves nothing back.
        mate = _engine(cfg, server.url, run="run", actor="actor-9", lora=lora, weights_dir="")
        push(mate, 2)
        assert _health(server)["weight_version"] == "3"
        tokens, logprobs, version = asyncio.run(_one_turn(ahead, context))
        assert version == 3
        np.testing.assert_allclose(
            logprobs, _lora_turn_logprobs(cfg, ad[3], context, tokens), atol=LOGPROB_ATOL
        )
    finally:
        server.close()


def test_a_lora_server_kept_across_runs_serves_each_turn_its_own_runs_adapter(tmp_path):
    """A LoRA run re-created under the same URI names its adapters as the old run did
    without digests (`<run>-v0`, ...): the one published later loads (vLLM's "already
    loaded" would have served the old run's). The next run's adapter drops the names of
    the run before, whose actor's next turn then finds its adapter gone (a 404) and loads
    it again: each turn is drawn by its own run's adapter."""
    cfg = _lora_cfg(tmp_path)
    lora = lora_spec(cfg.model)
    context = [TOK.bos_id, *TOK.encode("q3")]
    server = _Server(cfg)

    def push(engine: RemoteEngine, seed: int, v: int, t: float) -> None:
        engine.update_params(_adapters(cfg, seed), version=v, only=nnx.LoRAParam, created_at=t)

    def drawn_by(engine: RemoteEngine, seed: int) -> None:
        tokens, logprobs, version = asyncio.run(_one_turn(engine, context))
        assert version == 0
        expected = _lora_turn_logprobs(cfg, _adapters(cfg, seed), context, tokens)
        np.testing.assert_allclose(logprobs, expected, atol=LOGPROB_ATOL)

    try:
        first = _engine(cfg, server.url, run="run-a", lora=lora)
        push(first, 1, 0, 100.0)
        push(first, 2, 1, 101.0)
        again = _engine(cfg, server.url, run="run-a", lora=lora)  # re-created
        push(again, 9, 0, 200.0)
        drawn_by(again, 9)
        assert again._pushed[2] == "run-a-v0"
        other = _engine(cfg, server.url, run="run-b", lora=lora)
        push(other, 5, 0, 300.0)
        models = {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert models == {cfg.model.served_name, "run-b-v0"}
        drawn_by(again, 9)
        drawn_by(other, 5)
    finally:
        server.close()


def _peft_folder(folder, cfg: RunConfig, nan: bool = False, **config) -> str:
    """A PEFT folder as the engine writes it (`_adapters(1)`), its config's fields
    `config` changed, its first tensor NaN if `nan`."""
    folder.mkdir(parents=True)
    spec, lora = policy_spec(cfg.model)[1], lora_spec(cfg.model)
    tensors = adapters_to_peft(_adapters(cfg, 1), spec, lora)
    if nan:
        first = next(iter(tensors))
        tensors[first] = np.full_like(tensors[first], np.nan)
    save_file(tensors, str(folder / ADAPTER_FILE))
    (folder / ADAPTER_CONFIG).write_text(json.dumps(peft_config(lora, base="b") | config))
    return str(folder)


def test_adapter_pushes_are_checked_and_the_names_kept_are_bounded(tmp_path):
    """An adapter push is refused (400, the reason) for a name over 256 characters or
    whose version is not ASCII digits below 10**18, an adapter_config.json that is a
    FIFO, over 1 MiB, nested too deeply or of a shape PEFT's parser would not make, or a
    NaN tensor. The server keeps the newest `KEEP_ADAPTERS` names it loaded: older ones
    are a 404, as an unloaded adapter is. Once one is loaded, a turn naming the base model
    is a 400: the sampler holds the adapter's weights, not the base's alone."""
    cfg = _lora_cfg(tmp_path)
    server = _Server(cfg)
    good = _peft_folder(tmp_path / "good", cfg)
    bad = {
        "over the limit of 1048576 bytes": _peft_folder(
            tmp_path / "big", cfg, base_model_name_or_path="x" * (2 << 20)
        ),
        "a list of module names": _peft_folder(tmp_path / "tm", cfg, target_modules=[{"a": 1}]),
        "finite alpha > 0": _peft_folder(tmp_path / "alpha", cfg, lora_alpha=10**400),
        "NaN/Inf": _peft_folder(tmp_path / "nan", cfg, nan=True),
        "not a regular file": _peft_folder(tmp_path / "fifo", cfg),
        "nested too deeply": _peft_folder(tmp_path / "deep", cfg),
    }
    config = tmp_path / "fifo" / ADAPTER_CONFIG
    config.unlink()
    os.mkfifo(config)
    (tmp_path / "deep" / ADAPTER_CONFIG).write_bytes(b"[" * 100_000)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:

            def load(name: str, path: str = good) -> httpx.Response:
                return http.post(
                    "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
                )

            for name in ("x-v" + "9" * 20, "x-v\u0661\u0662", "x" * 300 + "-v1"):
                assert "at most 18 digits" in _refused(load(name), "lora_name")
            for reason, path in bad.items():
                assert reason in _refused(load("x-v1", path), "lora_name"), reason
            turn = {"prompt": [TOK.bos_id], "max_tokens": 2}
            assert http.post("/v1/completions", json=turn).status_code == 200  # the base
            names = [f"x-v{v}" for v in range(1, KEEP_ADAPTERS + 3)]
            for name in names:
                assert load(name).status_code == 200
            models = {m["id"] for m in http.get("/v1/models").json()["data"]}
            assert models == {cfg.model.served_name, *names[-KEEP_ADAPTERS:]}
            # The base alone is no longer what it samples: never served under its name.
            for base in ({}, {"model": cfg.model.served_name}):
                r = http.post("/v1/completions", json=turn | base)
                assert "not the base model alone: name an adapter" in _refused(r, "model")
            assert http.post("/v1/completions", json=turn | {"model": names[0]}).status_code == 404
            r = http.post("/v1/completions", json=turn | {"model": names[-1]})
            assert r.status_code == 200 and r.json()["weight_version"] == str(len(names))
    finally:
        server.close()


def _all_at_once(engines: list[RemoteEngine], push) -> None:
    """`push(engine)` in one thread per engine, released together; the first error raised."""
    start, errors = threading.Barrier(len(engines)), []

    def run(engine: RemoteEngine) -> None:
        start.wait()
        try:
            push(engine)
        except Exception as err:  # raised below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a push did not return"
    if errors:
        raise errors[0]


def test_a_dead_writers_claim_is_taken_over_and_its_leftovers_cleaned_up(tmp_path):
    """An actor died while writing a version: its claim and half folder stay, untouched,
    and its lock on the server. The next actor takes the claim and the lock over at once
    (not after `timeout_s`) and writes the folder; the leftovers go with the version's
    folder."""
    shared = tmp_path / "shared"
    cfg = _cfg(tmp_path, weights_dir=str(shared))
    run = shared / "run"
    run.mkdir(parents=True)
    name = f"v1-{_digest(1)[:16]}"
    dead = [run / f".{name}.claim", run / f".{name}.actor-9.partial"]
    dead[0].touch()
    dead[1].mkdir()
    stale = time.time() - shared_disk.CLAIM_STALE_S - 5
    for path in dead:
        os.utime(path, (stale, stale))
    server = _Server(cfg)
    try:
        engine = _engine(cfg, server.url, run="run")
        # It died while pushing to the server, too: the run's lock on that server stays.
        lock = shared_disk.ServerRecord(run, engine.url).lock
        lock.touch()
        os.utime(lock, (stale, stale))
        t0 = time.monotonic()
        engine.update_params(_peaky(1, cfg), version=1, digest=_digest(1))
        assert time.monotonic() - t0 < 30 and engine.folders_written == 1
        engine.update_params(_peaky(3, cfg), version=3, digest=_digest(3))
        assert _pushes(server) == 2 and not lock.exists()
    finally:
        server.close()
    assert _listing(run) == [f"v3-{_digest(3)[:16]}"]


def test_a_live_writer_slower_than_the_stale_limit_is_waited_for(tmp_path, monkeypatch):
    """A writer whose write outlasts the stale limit keeps its claim fresh by touching it:
    the other actor waits for its folder instead of writing the version a second time."""
    monkeypatch.setattr(shared_disk, "CLAIM_BEAT_S", 0.1)
    # 20 beats to the stale limit: a host stalled 1.9 s still keeps the claim fresh
    monkeypatch.setattr(shared_disk, "CLAIM_STALE_S", 2.0)

    def slow_save(*args, **kwargs) -> None:  # a large model on a slow shared disk
        time.sleep(3.0)
        save_file(*args, **kwargs)

    monkeypatch.setattr(remote_engine, "save_file", slow_save)
    cfg = _cfg(tmp_path, weights_dir=str(tmp_path / "shared"))
    server = _Server(cfg)
    try:
        fleet = [_engine(cfg, server.url, run="run", actor=f"actor-{i}") for i in range(2)]
        flat = _peaky(1, cfg)
        _all_at_once(fleet, lambda e: e.update_params(flat, version=1, digest=_digest(1)))
    finally:
        server.close()
    assert sum(e.folders_written for e in fleet) == 1


def test_a_folder_removed_before_the_server_read_it_is_written_again(tmp_path, monkeypatch):
    """Between finding a version's folder and the server reading it, the clean-up of an
    actor two versions ahead removed it: the server refuses the push (no such file), and
    the actor writes the folder again and pushes it, rather than refusing the version."""
    cfg = _cfg(tmp_path, weights_dir=str(tmp_path / "shared"))
    server = _Server(cfg)
    push = RemoteEngine._push
    removed = []

    async def removed_first(self, folder, name, version, created_at):
        if not removed:  # the other actor's clean-up, just before this push
            removed.append(folder)
            shutil.rmtree(folder)
        return await push(self, folder, name, version, created_at)

    monkeypatch.setattr(RemoteEngine, "_push", removed_first)
    try:
        engine = _engine(cfg, server.url, run="run")
        engine.update_params(_peaky(1, cfg), version=1, digest=_digest(1))
        assert removed and engine.version == 1 and engine.folders_written == 2
        tokens, logprobs, _ = asyncio.run(_one_turn(engine, [TOK.bos_id]))
        np.testing.assert_allclose(
            logprobs, _turn_logprobs(cfg, _peaky(1, cfg), [TOK.bos_id], tokens), atol=LOGPROB_ATOL
        )
    finally:
        server.close()


def test_an_unreachable_server_is_a_clear_error_after_the_deadline(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://user:secret@127.0.0.1:{s.getsockname()[1]}"
    cfg = _cfg(tmp_path)
    engine = _engine(cfg, url, timeout_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match=r"no answer within actor.remote.timeout_s=1.5s") as e:
        engine.update_params(_peaky(1, cfg), version=0)
    assert time.monotonic() - t0 < 10
    assert "secret" not in str(e.value) and "http://127.0.0.1:" in str(e.value)  # no userinfo
    with pytest.raises(RemoteError, match=r"/v1/models: no answer within"):
        asyncio.run(_one_turn(engine, [TOK.bos_id]))  # asks the server for its model first
    assert engine._client is None  # its HTTP client closed, not left to the collector


def test_the_bearer_token_is_required_and_sent(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    server = _Server(cfg, api_key="s3cret")
    try:
        with pytest.raises(RemoteError, match="HTTP 401") as err:
            _engine(cfg, server.url).update_params(_peaky(1, cfg), version=0)
        assert err.value.status == 401
        monkeypatch.setenv("TUNIX_TEST_KEY", "s3cret")
        engine = _engine(cfg, server.url, api_key_env="TUNIX_TEST_KEY")
        engine.update_params(_peaky(1, cfg), version=0)
        tokens, _, version = asyncio.run(_one_turn(engine, [TOK.bos_id]))
        assert version == 0 and tokens
        monkeypatch.delenv("TUNIX_TEST_KEY")
        with pytest.raises(ConfigError, match=r"\$TUNIX_TEST_KEY, which is unset"):
            _engine(cfg, server.url, api_key_env="TUNIX_TEST_KEY")
    finally:
        server.close()
