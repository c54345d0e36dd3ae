"""`tunix-tasks serve`: the run's own batched sampler behind the remote engine's contract.

The server a `RemoteEngine` (engine.py) talks to when no vLLM or SGLang is at hand: one
process on the accelerator samples for actors on other machines, and the contract's tests
run against it. The routes are the subset vLLM and SGLang serve (wire.py):

    POST /v1/completions            {"prompt": [ids], "max_tokens", "temperature", "top_k",
                                     "seed", "logprobs", "return_tokens_as_token_ids",
                                     "user"} -> text_completion: choices[0].token_ids,
                                     .logprobs.tokens / .token_logprobs, "weight_version"
    POST /update_weights_from_disk  {"model_path", "weight_version", "weight_run",
                                     "created_at"} -> {"success", "message",
                                     "weight_version", "weight_run"}
    POST /v1/load_lora_adapter      {"lora_name": "<name>-v<N>", "lora_path", "weight_run",
                                     "created_at"} (a LoRA run)
    POST /v1/unload_lora_adapter    {"lora_name"}; a turn's "model" names a loaded adapter
    GET  /v1/models, GET /health    {"status", "weight_version", "weights": {"pushes",
                                     "loads"}, "compile_count", "sampler"}; a 503 with
                                     "status": "failed" and "error" once the engine stopped

A prompt is token ids only (a text prompt is a 400: nothing here re-tokenizes); `user`
names a conversation whose KV cache the sampler keeps between its turns; temperature 0 is
greedy; the sampler stops at the run's chat format's stop ids (`stop_token_ids` is not
read). A weights folder is read as safetensors only (never unpickled), checked against
the model's names and shapes before it replaces anything, and swapped in between two
decode steps: a turn decoding across it reports the older version. Every actor of a fleet
pushes each version: one the held snapshot supersedes (`wire.supersedes`: of the same
run, a version at or below it published no later) is acknowledged without a load, so the
server's weights never go back. Another run's push loads: the run that pushes last has
the server (the next run on a server kept running, a run resumed after another used it),
and so does a run re-created under the same URI (versions from 0 again, published
later). Every reply names the run whose weights it holds (`weight_run`), so an actor of
the run it replaced stops with a clear error instead of sampling another run's weights;
a turn sampled while another run's weights loaded is a 409 (its tokens may be of two
runs' weights, even one switched away from and back), which stops its actor too.
A LoRA run's adapters (vLLM's routes) load as its sampler's LoRA params, their version
from the name's `-v<N>`; the sampler holds one set, so a turn naming an older adapter of
the run gets the newest (its reply says which version), one naming an adapter it does
not hold is a 404, as vLLM's (it holds the names of the `KEEP_ADAPTERS` loaded last, of
the run it serves), and once one is loaded, one naming the base model is a 400 (vLLM
would sample the base alone). Refusals are OpenAI error bodies (actor/endpoint/server.py); with
an API key every route needs the bearer.

What it is sent is checked before the engine thread sees it (an error there stops the
engine, and every later turn fails): a turn's settings within the sampler's bounds
(`_parse`), versions of at most 18 ASCII digits, publish times before tomorrow, run
names of printable ASCII, a folder's files read only as regular files no larger than the
model's tensors take (`_safetensors`), every value finite.

    asyncio.run(serve(cfg, host="0.0.0.0", port=8000, api_key=key))
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import re
import signal
import time
import uuid
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from pydantic import BaseModel, ConfigDict, Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tunix_tasks.actor.asynchronous.batching import BatchingPolicy
from tunix_tasks.actor.endpoint.server import ERROR_HANDLERS, EndpointServer, bearer, json_object
from tunix_tasks.actor.endpoint.wire import ApiError, validated
from tunix_tasks.actor.remote.wire import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    WEIGHTS_FILE,
    publish_time_problem,
    supersedes,
    token_label,
)
from tunix_tasks.config import RunConfig
from tunix_tasks.policy.build import build_actor_sampler, lora_spec
from tunix_tasks.policy.chat import ChatFormat
from tunix_tasks.policy.hf_adapters import (
    adapters_from_peft,
    lora_from_peft_config,
    peft_tensor_shapes,
)
from tunix_tasks.policy.hf_checkpoint import CheckpointError, params_from_hf
from tunix_tasks.policy.hf_headers import hf_tensor_shapes
from tunix_tasks.policy.requests import INT32_MAX, TEMPERATURES
from tunix_tasks.policy.spec import DecoderSpec, LoraSpec
from tunix_tasks.storage.snapshot_format import (
    BlobError,
    decode_safetensors,
    non_finite,
    short_repr,
)
from tunix_tasks.untrusted import json_loads, read_regular

__all__ = [
    "KEEP_ADAPTERS",
    "MAX_ADAPTER_NAME",
    "CompletionRequest",
    "Loaded",
    "build_app",
    "read_adapter",
    "read_weights",
    "serve",
]

log = logging.getLogger(__name__)


class CompletionRequest(BaseModel):
    """The fields of `POST /v1/completions` this server reads (module docstring)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    model: str = ""
    prompt: list[int] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = None
    n: int = Field(1, ge=1, le=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False
    user: str | None = Field(None, max_length=256)


def _parse(data: dict[str, Any], spec: DecoderSpec) -> CompletionRequest:
    """The request, its settings within what the sampler can run: ApiError 400 naming the
    bound otherwise (vLLM's for `top_k`), before anything reaches the engine thread."""
    if isinstance(data.get("prompt"), str):
        raise ApiError(
            400, "prompt: token ids only (this server does not tokenize)", param="prompt"
        )
    req = validated(CompletionRequest, data)
    bad = [t for t in req.prompt if not 0 <= t < spec.vocab_size]
    if bad:
        raise ApiError(400, f"prompt: ids {bad[:5]} outside [0, {spec.vocab_size})", param="prompt")
    low, high = TEMPERATURES
    if req.temperature != 0.0 and not low <= req.temperature <= high:
        raise ApiError(
            400,
            f"temperature: 0 (greedy) or in [{low:g}, {high:g}], got {req.temperature:g}",
            param="temperature",
        )
    if req.top_k > spec.vocab_size:
        raise ApiError(
            400,
            f"top_k: at most the vocabulary size ({spec.vocab_size}), got {req.top_k}",
            param="top_k",
        )
    return req


def _reason(err: BaseException) -> str:
    """What went wrong, in words: an OSError's reason without its errno and path."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err)


def _safetensors(path: Path, shapes: Iterable[tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The tensors of the safetensors file `path` whose expected tensors have `shapes`,
    every value finite. Read only if a regular file no larger than those tensors take at
    8 bytes a value (F64, the widest dtype read) and a header: a FIFO or a device would
    hang the load (and SIGTERM with it), a huge file fill the memory. ValueError naming
    the file and what is wrong."""
    limit = 8 + _HEADER_BYTES + 8 * sum(math.prod(shape) for shape in shapes)
    try:
        tensors = decode_safetensors(read_regular(path, limit))
    except (OSError, BlobError) as err:
        raise ValueError(f"{path}: {_reason(err)}") from None
    bad = non_finite(tensors)  # NaN weights would make every completion's JSON fail
    if bad is not None:
        raise ValueError(f"{path}: {bad}: not loaded")
    return tensors


def read_weights(folder: Path, spec: DecoderSpec) -> dict[str, Any]:
    """A checkpoint folder's `WEIGHTS_FILE` as our flat params; ValueError naming what is
    wrong (no file or not a regular one, too large, a corrupt header, a non-finite value,
    a missing tensor or a wrong shape)."""
    path = folder / WEIGHTS_FILE
    tensors = _safetensors(path, hf_tensor_shapes(spec).values())
    try:
        return params_from_hf(tensors, spec)
    except CheckpointError as err:
        raise ValueError(f"{path}: {err}") from None


@dataclasses.dataclass
class Loaded:
    """The weights the server holds: their version (-1: the base it started with), the
    run they are of and when it published them (None and 0 for the base, or a push that
    does not say); the weights pushes it was asked for and the loads they made (`GET
    /health`); and a LoRA run's adapter names it serves, each with its version: the
    `KEEP_ADAPTERS` loaded last."""

    version: int = -1
    run: str | None = None
    created_at: float = 0.0
    pushes: int = 0
    loads: int = 0
    switches: int = 0  # loads that replaced one run's weights with another's
    adapters: dict[str, int] = dataclasses.field(default_factory=dict)

    def superseded_by(self, run: str | None, created_at: float, version: int) -> bool:
        """Whether a push of this snapshot loads (`wire.supersedes`)."""
        return supersedes(run, created_at, version, held=(self.run, self.created_at, self.version))

    def hold(self, version: int, run: str | None, created_at: float) -> None:
        """The snapshot just loaded; another run's replaces that run's adapter names."""
        if run != self.run:
            if self.run is not None:
                self.switches += 1
                log.warning(
                    "now serving v%d of %s (it held run %s's v%d): that run's actors stop",
                    version,
                    "a push naming no run" if run is None else f"run {run}",
                    self.run,
                    self.version,
                )
            self.adapters.clear()
        self.version, self.run, self.created_at = version, run, created_at
        self.loads += 1

    def identity(self) -> dict[str, str]:
        """Whose weights a reply was drawn by: `weight_version`, and `weight_run` once a
        push named one."""
        held = {"weight_version": str(self.version)}
        return held if self.run is None else held | {"weight_run": self.run}


# A pushed version: ASCII digits ("²".isdigit() is true too), fewer than 19. A larger one
# would be loaded once, then every later push of the run acknowledged "already at" it
# (but one published later): frozen weights.
_VERSION = re.compile(r"[0-9]{1,18}")
# A run as a push names it (`run_weights_folder`: `<run_name>-<8 hex>`): echoed in replies
# and logged, so printable ASCII only.
_RUN = re.compile(r"[\x21-\x7e]{1,256}")
_ADAPTER_NAME = re.compile(r".*-v([0-9]{1,18})")
MAX_ADAPTER_NAME = 256  # characters of a lora_name
KEEP_ADAPTERS = 8  # adapter names served: the ones loaded last (older ones are a 404)
_CONFIG_BYTES = 1 << 20  # an adapter_config.json: ~1 KB
_HEADER_BYTES = 1 << 20  # a safetensors header: ~150 bytes a tensor


def _version(value: object) -> int:
    """`weight_version`: a JSON integer or a string of digits (SGLang's), below 10**18."""
    text = str(value) if type(value) is int else value  # bool is refused
    if not isinstance(text, str) or _VERSION.fullmatch(text) is None:
        raise ValueError(
            f"weight_version: a non-negative integer of at most 18 digits, got {short_repr(value)}"
        )
    return int(text)


def _whose(data: dict[str, Any]) -> tuple[str | None, float]:
    """A push's `weight_run` and `created_at` (None and 0 when it does not say: vLLM's
    and SGLang's callers); ValueError naming a bad one."""
    run, created_at = data.get("weight_run"), data.get("created_at", 0.0)
    if run is not None and (not isinstance(run, str) or _RUN.fullmatch(run) is None):
        raise ValueError(
            f"weight_run {short_repr(run)}: the run's name, 1 to 256 printable ASCII characters"
        )
    if problem := publish_time_problem(created_at):
        raise ValueError(problem)
    return run, float(created_at)


def read_adapter(folder: Path, spec: DecoderSpec, lora: LoraSpec) -> dict[str, Any]:
    """A PEFT folder's adapters as our flat LoRA params; ValueError naming what is wrong
    (no file or not a regular one, too large, an adapter_config.json not of this server's
    rank, alpha and targets, a corrupt header, a non-finite value, a missing tensor or a
    wrong shape)."""
    path = folder / ADAPTER_CONFIG
    try:
        config = json_loads(read_regular(path, _CONFIG_BYTES))
        theirs = lora_from_peft_config(config if isinstance(config, dict) else {})
        if theirs != lora:
            raise CheckpointError(f"{theirs} is not this server's {lora}")
    except (OSError, ValueError) as err:  # CheckpointError is a ValueError
        raise ValueError(f"{path}: {_reason(err)}") from None
    tensors = _safetensors(folder / ADAPTER_FILE, peft_tensor_shapes(spec, lora).values())
    try:
        return adapters_from_peft(tensors, spec, lora)
    except CheckpointError as err:
        raise ValueError(f"{folder / ADAPTER_FILE}: {err}") from None


def build_app(
    policy: BatchingPolicy,
    *,
    loaded: Loaded,
    chat: ChatFormat,
    spec: DecoderSpec,
    model_name: str,
    api_key: str | None = None,
    max_request_bytes: int = 1 << 22,
    lora: LoraSpec | None = None,
) -> Starlette:
    """The server's ASGI app over a started `policy` whose version callable reads
    `loaded` (module docstring)."""
    sampler = policy.sampler
    decode = chat.tokenizer.decode

    async def completions(request: Request) -> JSONResponse:
        req = _parse(await json_object(request, max_request_bytes), spec)
        named = req.model not in ("", model_name)
        if lora is not None and named and req.model not in loaded.adapters:
            # vLLM's answer for an adapter it does not hold (unloaded, or it restarted).
            raise ApiError(404, f"The model `{req.model}` does not exist.", param="model")
        if lora is not None and not named and loaded.version >= 0:
            # vLLM would sample the base alone; the sampler holds one set of weights, the
            # adapter's: refused, not served under the base's name.
            raise ApiError(
                400,
                f"this server samples with the adapter it loaded last (v{loaded.version}), "
                f"not the base model alone: name an adapter "
                f"({', '.join(loaded.adapters) or 'none is held now'})",
                param="model",
            )
        if policy.failed is not None:  # every turn would raise its error: say what to do
            raise ApiError(
                503,
                "the sampler stopped (GET /health says why): restart the server",
                type="server_error",
            )
        greedy = req.temperature == 0.0
        switches = loaded.switches
        try:
            s = await policy.sample(
                req.prompt,
                session=None if req.user is None else ("user", req.user),
                # The sampler stops at max_seq_len whatever was asked.
                max_new_tokens=min(req.max_tokens, spec.max_seq_len),
                temperature=1.0 if greedy else req.temperature,
                top_k=1 if greedy else max(req.top_k, 0),
                seed=req.seed,
                top_logprobs=req.logprobs or 0,
            )
        except ValueError as err:  # the sampler's bounds (context length, top_k, ...)
            raise ApiError(400, str(err)) from None
        if loaded.switches != switches:
            # Its tokens may be of two runs' weights, whichever run holds the server now
            # (one switched away and back): no reply names that.
            raise ApiError(
                409,
                "another run's weights were loaded while this turn was sampled: its tokens "
                "may be of two runs' weights; one server serves one run at a time",
                type="conflict",
            )

        def label(t: int) -> str:
            return token_label(t) if req.return_tokens_as_token_ids else decode([t])

        top = None
        if s.top_logprobs is not None:
            top = [{label(t): lp for t, lp in alts} for alts in s.top_logprobs]
        choice = {
            "index": 0,
            "text": decode(s.tokens),
            "token_ids": s.tokens,
            "finish_reason": "stop" if s.finish_reason == "stop" else "length",
            "logprobs": {
                "tokens": [label(t) for t in s.tokens],
                "token_logprobs": s.logprobs,
                "top_logprobs": top,
            },
        }
        return JSONResponse(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": len(req.prompt),
                    "completion_tokens": len(s.tokens),
                    "total_tokens": len(req.prompt) + len(s.tokens),
                },
                # The version that drew it (the oldest), the run held throughout.
                **loaded.identity(),
                "weight_version": str(s.version),
            }
        )

    one_load = asyncio.Lock()

    async def update_weights(request: Request) -> JSONResponse:
        data = await json_object(request, max_request_bytes)
        path, version = data.get("model_path"), data.get("weight_version")
        try:
            if not isinstance(path, str) or not path:
                raise ValueError("model_path: required (a checkpoint folder on this machine)")
            v = _version(version)
            run, created_at = _whose(data)
            loaded.pushes += 1
            # Every actor of a fleet pushes each version: load it once, never go back. A
            # snapshot held already waits for no load under way.
            message = None
            if loaded.superseded_by(run, created_at, v):
                async with one_load:
                    # The load that held the lock may have passed it.
                    if loaded.superseded_by(run, created_at, v):
                        flat = await asyncio.to_thread(read_weights, Path(path), spec)
                        await policy.between_steps(lambda: sampler.update_params(flat, version=v))
                        loaded.hold(v, run, created_at)
                        message = f"loaded {path}"
        except ValueError as err:  # nothing was swapped
            return JSONResponse({"success": False, "message": str(err)}, status_code=400)
        message = message or f"already at v{loaded.version}"
        return JSONResponse({"success": True, "message": message, **loaded.identity()})

    async def load_adapter(request: Request) -> JSONResponse:
        data = await json_object(request, max_request_bytes)
        name, path = data.get("lora_name"), data.get("lora_path")
        loaded.pushes += 1
        try:
            if lora is None:
                raise ValueError("this server's model has no LoRA (serve the run's config)")
            if not isinstance(path, str) or not path:
                raise ValueError("lora_path: required (a PEFT folder on this machine)")
            short = isinstance(name, str) and len(name) <= MAX_ADAPTER_NAME
            m = _ADAPTER_NAME.fullmatch(name) if short else None
            if m is None:
                raise ValueError(
                    f"lora_name {short_repr(name)}: <name>-v<version> (the remote engine's), "
                    f"at most {MAX_ADAPTER_NAME} characters and a version of at most 18 digits"
                )
            v = int(m[1])
            run, created_at = _whose(data)
            # vLLM's refusal, word for word; a name a re-created run gives again loads.
            if name in loaded.adapters and not loaded.superseded_by(run, created_at, v):
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            flat = await asyncio.to_thread(read_adapter, Path(path), spec, lora)  # checked
            async with one_load:
                # Older names of the run stay served, by the newest adapter: never back.
                if loaded.superseded_by(run, created_at, v):
                    update = partial(sampler.update_params, flat, version=v, only=nnx.LoRAParam)
                    await policy.between_steps(update)
                    loaded.hold(v, run, created_at)
                loaded.adapters[name] = v
                for old in list(loaded.adapters)[:-KEEP_ADAPTERS]:  # bounded: forgotten
                    del loaded.adapters[old]
        except ValueError as err:  # nothing was swapped
            raise ApiError(400, str(err), param="lora_name") from None
        added = f"Success: LoRA adapter '{name}' added"
        return JSONResponse({"success": True, "message": added, **loaded.identity()})

    async def unload_adapter(request: Request) -> JSONResponse:
        name = (await json_object(request, max_request_bytes)).get("lora_name")
        if not isinstance(name, str) or len(name) > MAX_ADAPTER_NAME:
            raise ApiError(
                400,
                f"lora_name {short_repr(name)}: a string of at most {MAX_ADAPTER_NAME} characters",
                param="lora_name",
            )
        if loaded.adapters.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
        return JSONResponse({"success": True, "message": f"Success: LoRA adapter '{name}' removed"})

    async def models(_request: Request) -> JSONResponse:
        entry = {"id": model_name, "object": "model", "created": 0, "owned_by": "tunix-tasks"}
        adapters = [entry | {"id": name, "parent": model_name} for name in loaded.adapters]
        return JSONResponse({"object": "list", "data": [entry, *adapters]})

    async def health(_request: Request) -> JSONResponse:
        # The compile count tells a benchmark (or an operator) nothing compiles in steady state.
        body: dict[str, Any] = {"status": "ok", **loaded.identity()}
        body["weights"] = {"pushes": loaded.pushes, "loads": loaded.loads}
        work = dataclasses.asdict(sampler.stats) | {"engine_steps": policy.calls}
        body |= {"compile_count": sampler.compile_count, "sampler": work}
        if policy.failed is None:
            return JSONResponse(body)
        # Every turn fails from now on: a health check must take the server out.
        error = f"{type(policy.failed).__name__}: {policy.failed}"[:300]
        return JSONResponse(body | {"status": "failed", "error": error}, status_code=503)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/update_weights_from_disk", update_weights, methods=["POST"]),
            Route("/v1/load_lora_adapter", load_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload_adapter, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers=ERROR_HANDLERS,
        middleware=bearer(api_key),
    )


async def serve(
    cfg: RunConfig,
    *,
    host: str,
    port: int,
    api_key: str | None = None,
    on_ready: Callable[[str], None] = lambda url: None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve the run's policy (its `model` and `actor` sampling settings) until `stop` is
    set (without one: until SIGTERM or SIGINT); `on_ready` gets the base URL once it
    listens (port 0: a free one)."""
    chat, sampler = build_actor_sampler(cfg)
    loaded = Loaded()
    policy = BatchingPolicy(
        sampler,
        version=lambda: loaded.version,
        max_new_tokens=cfg.actor.max_new_tokens,
        temperature=cfg.actor.temperature,
        top_k=cfg.actor.top_k,
        seed=cfg.seed,
        gather_s=cfg.actor.batch_wait_s,
    )
    app = build_app(
        policy,
        loaded=loaded,
        chat=chat,
        spec=sampler.model.spec,
        model_name=cfg.model.served_name,
        api_key=api_key,
        lora=lora_spec(cfg.model),
    )
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with policy, EndpointServer(app, host=host, port=port) as server:
        on_ready(server.base_url)
        await stop.wait()
