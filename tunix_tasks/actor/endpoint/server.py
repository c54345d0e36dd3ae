"""The HTTP surface: a Starlette app over an `EndpointService`, served by uvicorn.

    POST /episodes                                  {"group", "group_size", "seed"} ->
                                                    {"episode_id", "base_url"}
    POST /episodes/{id}/v1/chat/completions         OpenAI chat completions (wire.py)
    GET  /episodes/{id}/v1/models, GET /v1/models   the one model, OpenAI's list form
    POST /episodes/{id}/close                       {"reward" | "rewards", "truncated"} ->
                                                    {"status"} ("rewards": one per choice
                                                    of a last request with n > 1)

Every refusal is an OpenAI error body with its status (400 malformed JSON or a field of
the wrong type, 401 a missing or wrong bearer token, 404 an unknown episode or route, 409
a conversation that does not extend the episode's or an ended episode, 413 a body over
`max_request_bytes`, 429 too many requests or open episodes (or a new group while flow control pauses), 500 an internal error,
logged, never a traceback). With `api_key` set every route needs `Authorization: Bearer
<key>` (required when the endpoint binds beyond the loopback: config/agent.py).

`EndpointServer` runs the app on the caller's event loop (uvicorn without its own signal
handling: the actor's handlers stop the run) and sweeps abandoned episodes:

    async with EndpointServer(app, host="127.0.0.1", port=0, registry=reg) as server:
        server.base_url        # http://127.0.0.1:<port>
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from tunix_tasks.actor.endpoint.episodes import EpisodeRegistry
from tunix_tasks.actor.endpoint.service import EndpointService
from tunix_tasks.actor.endpoint.wire import (
    ApiError,
    body_object,
    completion_chunks,
    parse_request,
)

__all__ = [
    "ERROR_HANDLERS",
    "EndpointServer",
    "bearer",
    "build_app",
    "json_object",
]

log = logging.getLogger(__name__)


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes before more is read."""
    declared = request.headers.get("content-length")
    # ASCII digits only ("²".isdigit() is true; int() refuses it), and few enough for int().
    digits = declared is not None and declared.isascii() and declared.isdigit()
    if digits and (len(declared) > 18 or int(declared) > limit):
        raise ApiError(413, f"the request body has {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def json_object(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object (an empty body: {}); ApiError 400 or 413."""
    return body_object(await _body(request, limit) or b"{}")


def _disconnect(request: Request):
    """An awaitable that returns once the client has gone away (ASGI `http.disconnect`;
    the body is read already, so nothing else arrives), without polling."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


def _field(data: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = data.get(name, default)
    if value is not default and (
        (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind)
    ):
        raise ApiError(
            400, f"{name}: expected {getattr(kind, '__name__', kind)}, got {value!r}", param=name
        )
    return value


def build_app(
    service: EndpointService,
    *,
    api_key: str | None = None,
    max_request_bytes: int = 1 << 20,
    default_group_size: int = 1,
) -> Starlette:
    """The endpoint's ASGI app (module docstring)."""
    registry = service.registry

    async def open_episode(request: Request) -> JSONResponse:
        data = await json_object(request, max_request_bytes)
        group = _field(data, "group", str, None)
        # An unnamed group cannot be joined: it is a group of one unless said otherwise.
        size = _field(data, "group_size", int, default_group_size if group is not None else 1)
        seed = _field(data, "seed", int, 0)
        if not 1 <= size <= 64:
            raise ApiError(400, f"group_size: must be in 1..64, got {size}", param="group_size")
        ep = registry.open(group=group, group_size=size, seed=seed)
        base = str(request.base_url).rstrip("/")
        return JSONResponse({"episode_id": ep.id, "base_url": f"{base}/episodes/{ep.id}/v1"})

    async def close_episode(request: Request) -> JSONResponse:
        data = await json_object(request, max_request_bytes)
        rewards = _field(data, "rewards", list, None)
        if rewards is not None and not all(
            isinstance(r, int | float) and not isinstance(r, bool) for r in rewards
        ):
            raise ApiError(400, "rewards: must be a list of numbers", param="rewards")
        reward = _field(data, "reward", (int, float), None if rewards is None else 0.0)
        if reward is None:
            raise ApiError(400, "reward: required (a number)", param="reward")
        truncated = _field(data, "truncated", bool, False)
        episodes = registry.close(
            request.path_params["episode_id"],
            reward=float(reward),
            rewards=None if rewards is None else [float(r) for r in rewards],
            truncated=truncated,
        )
        return JSONResponse({"status": "closed" if episodes else "dropped: no_turns"})

    async def chat_completions(request: Request) -> Response:
        chat_request = parse_request(await _body(request, max_request_bytes))
        body = await service.complete(
            request.path_params["episode_id"], chat_request, disconnected=_disconnect(request)
        )
        if not chat_request.stream:
            return JSONResponse(body)
        usage = bool((chat_request.stream_options or {}).get("include_usage"))
        events = [
            f"data: {json.dumps(c)}\n\n" for c in completion_chunks(body, include_usage=usage)
        ]
        return Response("".join([*events, "data: [DONE]\n\n"]), media_type="text/event-stream")

    async def models(request: Request) -> JSONResponse:
        if "episode_id" in request.path_params:
            registry.get(request.path_params["episode_id"])
        name = service.limits.model
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": name, "object": "model", "created": 0, "owned_by": "tunix-tasks"}],
            }
        )

    return Starlette(
        routes=[
            Route("/episodes", open_episode, methods=["POST"]),
            Route("/episodes/{episode_id}/close", close_episode, methods=["POST"]),
            Route("/episodes/{episode_id}/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/episodes/{episode_id}/v1/models", models, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
        ],
        exception_handlers=ERROR_HANDLERS,
        middleware=bearer(api_key),
    )


async def _api_error(_request: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, ApiError)
    return JSONResponse(err.body, status_code=err.status)


async def _http_error(_request: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, HTTPException)
    return JSONResponse(
        ApiError(err.status_code, str(err.detail)).body, status_code=err.status_code
    )


async def _internal_error(request: Request, err: Exception) -> JSONResponse:
    log.exception("endpoint: %s %s failed", request.method, request.url.path)
    body = ApiError(500, f"internal error: {type(err).__name__}", type="server_error").body
    return JSONResponse(body, status_code=500)


#: Every refusal as an OpenAI error body; an unexpected error as a logged 500, never a
#: traceback to the client (also the rollout server's: actor/remote/server.py).
ERROR_HANDLERS = {ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error}


def bearer(api_key: str | None) -> list[Middleware]:
    """The middleware that refuses (401) a request without `Authorization: Bearer
    <api_key>`; none without a key."""
    return [Middleware(_Bearer, key=api_key)] if api_key else []


class _Bearer:
    """Refuses (401) every request without `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, *, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = ApiError(401, "a valid bearer token is required", code="invalid_api_key")
                await JSONResponse(err.body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the actor's own signal handlers stop the run
        yield


class EndpointServer:
    """Serves `app` on the running event loop; sweeps `registry` (if any) every `sweep_s`."""

    def __init__(
        self,
        app: Starlette,
        *,
        host: str,
        port: int,
        registry: EpisodeRegistry | None = None,
        sweep_s: float = 1.0,
    ) -> None:
        self._server = _Server(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                log_level="warning",
                lifespan="off",
                access_log=False,
                # Agents pause between turns (tools, envs): keep their connections open.
                timeout_keep_alive=120,
            )
        )
        self._host = host
        self._registry = registry
        self._sweep_s = sweep_s
        self._tasks: list[asyncio.Task] = []
        self.port = port

    @property
    def base_url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    async def __aenter__(self) -> EndpointServer:
        serve = asyncio.create_task(self._server.serve())
        self._tasks = [serve]
        if self._registry is not None:
            self._tasks.append(asyncio.create_task(self._sweep()))
        while not self._server.started:
            if serve.done():  # e.g. the port is taken
                serve.result()
                raise RuntimeError(f"the endpoint did not start on {self._host}:{self.port}")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.should_exit = True
        for task in self._tasks[1:]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _sweep(self) -> None:
        assert self._registry is not None
        while True:
            await asyncio.sleep(self._sweep_s)
            self._registry.sweep()
