"""`RemoteEngine`: an async actor's turns sampled by a completions server (vLLM, SGLang,
`tunix-tasks serve`), its new weights pushed there.

It is the actor's `RolloutEngine` (update_params, compile_count) and its rollout `Policy`
(one turn per call) at once; the actor needs no model of its own, only the shapes to
write a checkpoint (`policy_spec`):

    engine = RemoteEngine(cfg.actor.remote, chat=chat, spec=spec, max_new_tokens=16,
                          temperature=1.0, top_k=0, seed=7, connections=8,
                          run_folder=run_weights_folder(cfg.run_name, cfg.run_uri),
                          actor_id="actor-0")
    engine.update_params(flat, version=0, digest=manifest.sha256,
                         created_at=manifest.created_at)  # any thread: the folder written
    #   (or found: another actor of the run wrote it), the server told (unless it holds it)
    async with engine:                        # the event loop's HTTP client
        tokens, logprobs, version = await engine(context, session="ep-1")

A turn carries the weights version that was current when it was asked for: a push while
it decodes makes that the oldest version that drew its tokens (what the learner's
staleness bound needs), and the server's log-probs are those of the weights that drew
each token (what importance weights need). A server that reports older weights than
were pushed (it restarted) gets them pushed again, once for all the turns that noticed,
and the turn is asked again.
Unreachable or busy (429, 5xx), the server is asked again with backoff for `timeout_s`;
then, or on a refusal, `RemoteError` stops the actor with the server's message. A push
the server refuses with a 400 (bad shapes) is a ValueError: the weights client refuses
that version and the server keeps its weights.

A fleet shares each version's folder: `<weights_dir>/<run folder>/v<N>-<digest>`, named by
the snapshot's content (its manifest's sha256, so a run re-created under the same URI,
counting versions from 0 again, never finds the old run's folder). The first actor to
need it claims it (`.v<N>-<digest>.claim`, created exclusively, touched while it writes)
and writes it; the others wait for it and push the same folder. A claim untouched for
30 s is a dead writer's and is taken over; past `timeout_s` a waiter writes it too. Once
the server holds v<N>, folders before v<N-1> go: one version behind stays for an actor
(or its server) that is still a version behind; a folder that went before the server
read it is written again. Without a digest (a direct caller) the actor writes
`v<N>-<actor id>` every time.

A fleet shares its server too: the run's actors push to it one at a time (the claim of
its `ServerRecord`, shared_disk.py), and each records what the server then holds. An
actor whose snapshot a fleet mate pushed since it started, or that lags (the record
holds one the learner published later), pushes nothing: each snapshot is loaded once,
and the server's weights never go back, a restore after a restart included.

A server serves one run: each push names the run and when the learner published it;
`tunix-tasks serve` gives itself to the run that pushes last (`wire.supersedes`) and
names that run in its replies. A reply naming another run (the next run took over a
server kept running, or two live runs were given one) is a `RemoteError`: the actor
stops, no turn of another run's weights recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from tunix_tasks.actor.remote.shared_disk import (
    CLAIM_STALE_S,
    DIGEST,
    ServerRecord,
    age_s,
    claimed,
    touching,
)
from tunix_tasks.actor.remote.wire import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    WEIGHTS_FILE,
    RemoteError,
    adapter_request,
    completion_request,
    parse_completion,
    served_run,
    served_version,
    weights_request,
)
from tunix_tasks.config.agent import api_key_from_env
from tunix_tasks.config.remote import RemoteEngineConfig
from tunix_tasks.policy.chat import ChatFormat
from tunix_tasks.policy.hf_adapters import adapters_to_peft, peft_config
from tunix_tasks.policy.hf_checkpoint import CheckpointError, params_to_hf
from tunix_tasks.policy.spec import DecoderSpec, LoraSpec
from tunix_tasks.storage.snapshot_format import short_repr

__all__ = ["RemoteEngine", "RemoteError", "run_weights_folder"]


def run_weights_folder(run_name: str, run_uri: str, run_id: str = "") -> str:
    """A run's folder under `weights_dir`: `<run_name>-<8 hex of the run's URI and id>`.
    A shared `weights_dir` outlives a run and serves several, and two stores may hold runs
    of one name: a bare run name would let one run's clean-up delete the folder another
    run's server is loading. The id (`storage.runs.run_id`; "" for a run created before
    runs had one) tells a run re-created under the same URI from the deleted one, whose
    actors may still run: the name is also whose weights a server holds (`weight_run`)."""
    named = f"{run_uri}#{run_id}" if run_id else run_uri
    tag = hashlib.sha256(named.encode()).hexdigest()[:8]
    return f"{run_name}-{tag}"


log = logging.getLogger(__name__)

# Worth asking again: the server is starting, overloaded or restarting.
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_MAX_BACKOFF_S = 5.0
_ASKS = 4  # a turn asked again after restores: a server that keeps restarting stops the actor
# What the engine puts in a run's folder: `v<N>-<tag>`, and its leftovers `.v<N>-<tag>.*`;
# and each server's record's (shared_disk.py).
_VERSIONED = re.compile(r"(\.?)v(\d+)-[^/]*")
_RECORD_LEFTOVERS = re.compile(r"\.server-.*\.(partial|stale)")


class RemoteEngine:
    """`actor.remote` (module docstring)."""

    def __init__(
        self,
        cfg: RemoteEngineConfig,
        *,
        chat: ChatFormat,
        spec: DecoderSpec,
        max_new_tokens: int,
        temperature: float,
        top_k: int,
        seed: int,
        connections: int,
        run_folder: str,
        actor_id: str,
        config_json: Path | None = None,
        lora: LoraSpec | None = None,
    ) -> None:
        self.cfg = cfg
        self.url = cfg.url.rstrip("/")
        parts = urlsplit(self.url)  # what messages name: never the URL's credentials
        self._shown_url = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
        key = api_key_from_env(cfg.api_key_env, what="actor.remote.api_key_env")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._spec = spec
        self._stop_ids = tuple(chat.stop_ids)
        self._config_json = config_json
        self._lora = lora  # a LoRA run's: its snapshots are adapters, pushed by name
        self._run_folder = run_folder
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self._seed = seed
        self._connections = max(1, connections)
        # A temporary folder unless the server reads from a shared one (removed at exit).
        self._tmp = None if cfg.weights_dir else tempfile.TemporaryDirectory(prefix="tunix-w-")
        # The run's folder: its actors share it, each version written once (module docstring).
        self.weights_dir = Path(cfg.weights_dir or self._tmp.name) / run_folder
        self._record = ServerRecord(self.weights_dir, self.url)  # what the server holds
        self._actor_id = actor_id
        self.folders_written = 0  # folders this actor wrote (a copy that lost the race too)
        self.loads_skipped = 0  # pushes left out: the server held this snapshot or a newer one
        self._started = time.time()  # a server record older than this may be stale
        self._model = cfg.model
        self._client: aiohttp.ClientSession | None = None
        self._requests = itertools.count()
        self._in_flight = 0
        self._restoring: asyncio.Lock | None = None  # the event loop's (`__aenter__`)
        self._restores = 0  # pushes a turn made after a restart: one per restart, not per turn
        # (version, its folder, its adapter name or None) the server acknowledged, set at
        # once (the event loop reads it while a reload thread pushes); the folder is kept
        # to push it again, the name is what turns give as their model.
        self._pushed: tuple[int, Path, str | None] | None = None
        self._pushed_created_at = 0.0  # its snapshot's: what a restore compares the record by
        self.latency_s: list[float] = []  # per turn, request -> reply
        self.batch_sizes: list[int] = []  # turns in flight when each was asked for

    @property
    def version(self) -> int:
        """The weights version the server holds (as last acknowledged); -1 before any."""
        return -1 if self._pushed is None else self._pushed[0]

    @property
    def compile_count(self) -> int:
        return 0  # nothing is compiled here; the server compiles what it runs

    def _http(self) -> aiohttp.ClientSession:
        # aiohttp, not httpx: at 64 turns in flight httpx's pool took 0.77 of a core and
        # cut the turns/s to a quarter (benchmarks/remote_engine.py); aiohttp 0.07.
        return aiohttp.ClientSession(
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(
                total=self.cfg.timeout_s, connect=min(10.0, self.cfg.timeout_s)
            ),
            connector=aiohttp.TCPConnector(limit=self._connections),
        )

    async def __aenter__(self) -> RemoteEngine:
        self._client = self._http()
        self._restoring = asyncio.Lock()
        try:
            if not self._model:
                models = await self._call(self._client, "GET", "/v1/models", None)
                try:
                    self._model = str(models["data"][0]["id"])
                except (KeyError, IndexError, TypeError):
                    raise RemoteError(
                        f"{self._shown_url}/v1/models lists no model: {models}"
                    ) from None
        except BaseException:  # `async with` calls no __aexit__: close the client here
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def __call__(
        self,
        context: Sequence[int],
        *,
        session: Hashable | None = None,
        max_new_tokens: int | None = None,
        **_conversation: object,
    ) -> tuple[list[int], list[float], int]:
        """One turn: (tokens, behaviour log-probs, weights version) (module docstring)."""
        if self._client is None:
            raise RuntimeError("use `async with RemoteEngine(...)` before calling it")
        version, _, adapter = self._pushed or (-1, None, None)
        room = self._spec.max_seq_len - len(context)
        if room <= 0:  # as the local sampler: a full context samples nothing
            return [], [], version
        body = completion_request(
            model=self._model,
            adapter=adapter,
            prompt=context,
            max_tokens=min(max_new_tokens or self.max_new_tokens, room),
            temperature=self.temperature,
            top_k=self.top_k,
            seed=(self._seed * 1_000_003 + next(self._requests)) & 0x7FFFFFFF,
            stop_ids=self._stop_ids,
            session=None if session is None else str(session),
        )
        self._in_flight += 1
        self.batch_sizes.append(self._in_flight)
        t0 = time.perf_counter()
        try:
            restored = False  # this turn had the weights pushed again
            served: int | None = None
            for ask in range(1, _ASKS + 1):
                restores = self._restores  # as the turn is asked
                try:
                    reply = await self._call(self._client, "POST", "/v1/completions", body)
                except RemoteError as err:
                    if err.status == 409:  # tunix-tasks serve: another run's load mid-turn
                        raise self._other_run(
                            "loaded another run's weights while this turn was sampled"
                        ) from None
                    if err.status != 404 or adapter is None or restored:
                        raise
                    # The server does not hold this turn's adapter (it restarted, or a
                    # fleet mate unloaded it): load the newest, and ask again naming it.
                    await self._restore_adapter(adapter)
                    restored = True
                    version, _, adapter = self._pushed or (-1, None, None)
                    body["model"] = body["lora_path"] = adapter
                    continue
                self._same_run(reply)
                served = served_version(reply)
                if served is None or served >= version:
                    break
                if restored:
                    raise RemoteError(
                        f"the server still serves v{served} after v{version} was pushed"
                    )
                if ask == _ASKS:  # no ask left to use a push for
                    break
                # The server lost the pushed weights (it restarted): this turn came from
                # others. Push them again (unless a restore since it was asked did) and ask
                # again.
                restored = await self._restore(served, restores)
            if served is not None and served < version:
                raise RemoteError(
                    f"the server kept losing its weights: {_ASKS} asks for a turn, each "
                    f"answered by weights older than v{version} (is it restarting?)"
                )
        finally:
            self._in_flight -= 1
        self.latency_s.append(time.perf_counter() - t0)
        del self.latency_s[:-10000], self.batch_sizes[:-10000]
        turn = parse_completion(reply, vocab_size=self._spec.vocab_size)
        return turn.tokens, turn.logprobs, version

    def _same_run(self, reply: Any) -> None:
        """RemoteError when the server says it holds another run's weights (module
        docstring); a server that does not say (vLLM, SGLang) is taken at its word."""
        run = served_run(reply)
        if run is not None and run != self._run_folder:
            raise self._other_run(
                f"now serves run {short_repr(run)}'s weights, not this run's ({self._run_folder!r})"
            )

    def _other_run(self, what: str) -> RemoteError:
        """The error that stops an actor of a run whose server another run took over."""
        return RemoteError(
            f"the server at {self._shown_url} {what}: it serves the run that pushed to it last; give "
            "each live run its own server (actor.remote.url)"
        )

    async def _restore(self, served: int, restores: int) -> bool:
        """Push the weights again: the server serves `served`, older than this actor
        pushed (it restarted). Once for all the turns that noticed at once: a turn asked
        before a restore (`restores`: the count when it was asked) is asked again, without
        a push (vLLM and SGLang load every push, a 16-32 GB read for an 8B model). Whether
        this call pushed."""
        if self._pushed is not None and self._pushed[2] is not None:
            await self._restore_adapter(self._pushed[2])  # adapters go by name
            return True
        async with self._restoring:
            pushed = self._pushed
            if pushed is None or pushed[0] <= served or self._restores != restores:
                return False
            version, folder, _ = pushed
            # An actor ahead of this one had it load a later snapshot: restore that one, not
            # this actor's own (the server's weights must not go back).
            created_at, held = self._pushed_created_at, self._record.read()
            if held is not None and held["created_at"] > created_at:
                later = self._shared(held["version"], held["digest"])
                if (later / WEIGHTS_FILE).is_file():
                    version, folder, created_at = held["version"], later, held["created_at"]
            log.warning("the server serves v%d, not v%d: pushing v%d", served, pushed[0], version)
            body = self._weights_request(folder, version, created_at)
            assert self._client is not None
            try:
                reply = await self._call(self._client, "POST", self.cfg.weights_route, body)
            except RemoteError:
                if self._pushed is not pushed:  # a newer push replaced (and removed) it
                    return False
                raise
            if not isinstance(reply, dict) or reply.get("success") is not True:
                raise RemoteError(f"the server refused v{version} again: {str(reply)[:300]}")
            self._restores += 1
            return True

    def _weights_request(self, folder: Path, version: int, created_at: float) -> dict[str, Any]:
        return weights_request(
            str(folder.resolve()), version=version, run=self._run_folder, created_at=created_at
        )

    # -- weights -------------------------------------------------------------------
    def update_params(
        self,
        flat: Mapping[str, np.ndarray],
        *,
        version: int,
        only: type[nnx.Variable] = nnx.Param,
        digest: str = "",
        created_at: float = 0.0,
    ) -> None:
        """Write `flat` as a Hugging Face checkpoint folder, or (`only=nnx.LoRAParam`, a
        LoRA run's adapters) as a PEFT folder, or find it written by another actor of the
        run (same `digest`), and have the server load it: a checkpoint as the weights, an
        adapter under its name (`_adapter_name`), which turns then give as their model.
        Unless another actor of the run had it load this snapshot, or one the learner
        published later (`created_at`: this actor lags; it uses that one). From a thread
        without a running event loop: the runtime's reload. A `digest` that is not a
        sha256 (64 lowercase hex: it names a folder) is a ValueError."""
        adapter = only is not nnx.Param
        if adapter and self._lora is None:
            raise ValueError("an adapter snapshot, but this engine was given no LoRA spec")
        if digest:
            folder = self._shared(version, digest)
        else:  # nothing names the content: a folder of this actor's, written afresh
            folder = self.weights_dir / f"v{version}-{self._actor_id}"
        name = self._adapter_name(version, digest) if adapter else None

        def fill(into: Path) -> None:  # the folder's files
            try:
                if name is None:
                    tensors = params_to_hf(flat, self._spec)
                    save_file(tensors, str(into / WEIGHTS_FILE), metadata={"format": "pt"})
                    if self._config_json is not None:  # the base's, for servers reading it
                        shutil.copyfile(self._config_json, into / "config.json")
                    return
                assert self._lora is not None
                tensors = adapters_to_peft(flat, self._spec, self._lora)
                save_file(tensors, str(into / ADAPTER_FILE), metadata={"format": "pt"})
                config = peft_config(self._lora, base=self._model or "base")
                (into / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
            except CheckpointError as err:
                raise ValueError(f"v{version}: {err}") from None

        for attempt in range(2):
            try:
                if digest:
                    used = self._load_shared(folder, version, digest, created_at, fill, name)
                else:
                    used = (self._write(folder, fill), name)
                    self._load(*used, version, created_at)
                break
            except RemoteError as err:
                # Found, then removed by the clean-up of an actor two versions ahead before
                # the server read it: SGLang says 400, vLLM (an adapter) 404.
                gone = bool(digest) and not any(folder.glob("*.safetensors"))
                missing = err.status == 400 or (err.status == 404 and name is not None)
                if attempt == 0 and gone and missing:
                    log.warning("%s went before the server read it: writing it again", folder)
                    continue
                if err.status != 400:  # auth or a missing route: the actor stops
                    raise
                raise ValueError(f"the server refused weights v{version}: {err}") from None
        self._pushed = (version, *used)
        self._pushed_created_at = created_at
        self._clean(version)

    def _shared(self, version: int, digest: str) -> Path:
        """The run's folder of snapshot `version` whose manifest's sha256 is `digest`;
        ValueError for a digest that is not one (it names a folder: never one elsewhere)."""
        if DIGEST.fullmatch(digest) is None:
            raise ValueError(f"digest {short_repr(digest)}: not a sha256 (64 lowercase hex)")
        folder = self.weights_dir / f"v{version}-{digest[:16]}"
        assert folder.parent == self.weights_dir, folder
        return folder

    def _adapter_name(self, version: int, digest: str) -> str:
        """`<run folder>-<8 hex of the digest>-v<N>`: a run re-created under the same URI
        names its snapshots apart from the old run's (vLLM keeps serving a name it holds);
        `<run folder>-v<N>` without a digest."""
        tag = f"-{digest[:8]}" if digest else ""
        return f"{self._run_folder}{tag}-v{version}"

    def _load(self, folder: Path, name: str | None, version: int, created_at: float) -> None:
        """Have the server load `folder`: as weights `version`, or as adapter `name`."""
        reply = asyncio.run(self._push(folder, name, version, created_at))
        if name is None and (not isinstance(reply, dict) or reply.get("success") is not True):
            raise ValueError(f"the server refused weights v{version}: {str(reply)[:300]}")
        if isinstance(reply, dict) and reply.get("success") is False:  # SGLang's refusal
            raise ValueError(f"the server refused adapter {name}: {str(reply)[:300]}")

    def _load_shared(
        self,
        folder: Path,
        version: int,
        digest: str,
        created_at: float,
        fill: Callable[[Path], None],
        name: str | None,
    ) -> tuple[Path, str | None]:
        """Have the server load the run's shared `folder` (written here unless another
        actor wrote it), unless its record says an actor of the run had it load one the
        learner published later (this actor lags: nothing to write or push, and the
        server's weights must not go back: an adapter run's turns name that later
        adapter), or this snapshot since this engine started. The run's actors push to a
        server one at a time (the record's claim), so each snapshot is loaded once: vLLM
        and SGLang load every push, a 16-32 GB read for an 8B model. A record from before
        this engine started is not trusted with its own snapshot: the server may have
        restarted with the actor (vLLM reports no version). Returns the (folder, adapter
        name) the server holds for this actor. An adapter's load unloads the one loaded
        two loads before (the record keeps the one before: what a lagging actor names)."""
        record = self._record

        def held() -> tuple[Path, str | None] | None:  # read without the claim too
            now = record.read()
            if now is None:
                return None
            if created_at > 0 and now["created_at"] > created_at:  # this actor lags
                if name is None:  # a restore pushes the record's, labelled as it is
                    return folder, None
                later = self._shared(now["version"], now["digest"])
                return later, self._adapter_name(now["version"], now["digest"])
            same = (now["version"], now["digest"]) == (version, digest)
            return (folder, name) if same and now["written"] >= self._started else None

        if (found := held()) is not None:
            self.loads_skipped += 1
            return found
        self._shared_folder(folder, fill)
        # No deadline: a live holder's push ends within its own timeout_s, and pushing
        # beside it could move the server's weights back.
        with claimed(record.lock, ready=lambda: held() is not None, timeout_s=None) as mine:
            if not mine or (found := held()) is not None:  # it may have landed meanwhile
                self.loads_skipped += 1
                return found or (folder, name)
            before = record.read() or {"version": None, "digest": None, "previous": None}
            held_before = (before["version"], before["digest"])
            again = held_before == (version, digest)  # a restarted actor's push of the same
            self._load(folder, name, version, created_at)
            record.write(
                version=version,
                digest=digest,
                created_at=created_at,
                writer=self._actor_id,
                previous=before["previous"] if again or before["version"] is None else held_before,
            )
        if name is not None and not again and before["previous"] is not None:  # two back
            asyncio.run(self._unload(self._adapter_name(*before["previous"])))
        return folder, name

    def _shared_folder(self, folder: Path, fill: Callable[[Path], None]) -> None:
        """`folder`, written here unless another actor wrote it. One that is writing it
        (its claim is fresh) is waited for, up to `timeout_s`; a stale claim (its writer
        died) is taken over; past `timeout_s` it is written here too. At worst a version
        is written twice: the first complete copy wins."""
        claim = folder.with_name(f".{folder.name}.claim")
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        with claimed(claim, ready=folder.is_dir, timeout_s=self.cfg.timeout_s) as mine:
            # Claimed: the folder may have landed since it was looked for.
            if mine and not folder.is_dir():
                self._write(folder, fill, shared=True)

    def _write(self, folder: Path, fill: Callable[[Path], None], *, shared: bool = False) -> Path:
        """Write `folder` whole (`fill` writes its files; the server never sees half of
        one), touching the half-written folder while it writes. `shared`: a copy that
        landed meanwhile wins (same content); else an older folder of that name goes (this
        actor's own, from a run re-created under the same URI)."""
        partial = folder.with_name(f".{folder.name}.{self._actor_id}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            with touching([partial]):
                fill(partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        self.folders_written += 1
        if not shared:
            shutil.rmtree(folder, ignore_errors=True)
        try:
            partial.rename(folder)
        except OSError:
            if not shared or not folder.is_dir():
                raise
            shutil.rmtree(partial, ignore_errors=True)  # another actor's copy landed first
        return folder

    def _clean(self, version: int) -> None:
        """The server holds `version`: remove the run's folders from before `version - 1`
        (a shared `weights_dir`; the actor's own temporary one keeps `version` alone), and
        claims and half-written folders that old, and half-written records, whose writer
        stopped (untouched for `CLAIM_STALE_S`)."""
        oldest = version - 1 if self.cfg.weights_dir else version
        for entry in self.weights_dir.iterdir():
            m = _VERSIONED.fullmatch(entry.name)
            if m is not None and not m.group(1):
                if int(m.group(2)) < oldest:
                    shutil.rmtree(entry, ignore_errors=True)
                continue
            stopped = (m is not None and int(m.group(2)) < oldest) or (
                _RECORD_LEFTOVERS.fullmatch(entry.name) is not None
            )
            if stopped and age_s(entry) > CLAIM_STALE_S:
                with contextlib.suppress(OSError):  # another actor removed it first
                    (shutil.rmtree if entry.is_dir() else os.unlink)(entry)

    async def _push(self, folder: Path, name: str | None, version: int, created_at: float) -> Any:
        async with self._http() as client:
            if name is None:
                body = self._weights_request(folder, version, created_at)
                return await self._call(client, "POST", self.cfg.weights_route, body)
            return await self._push_adapter(client, folder, name, created_at)

    async def _push_adapter(
        self, client: aiohttp.ClientSession, folder: Path, name: str, created_at: float
    ) -> Any:
        """Load the PEFT `folder` as adapter `name`: the reply (vLLM's is text), None if
        the server has it already (vLLM's 400 "... has already been loaded")."""
        body = adapter_request(
            name, str(folder.resolve()), run=self._run_folder, created_at=created_at
        )
        try:
            return await self._call(client, "POST", self.cfg.adapter_route, body, json_only=False)
        except RemoteError as err:
            if err.status == 400 and "has already been loaded" in str(err):
                return None
            raise

    async def _unload(self, name: str) -> None:
        """Unload adapter `name`; best effort: one a restart removed first is a 404."""
        async with self._http() as client:
            with contextlib.suppress(RemoteError):
                body = {"lora_name": name}
                await self._call(client, "POST", self.cfg.unload_route, body, json_only=False)

    async def _restore_adapter(self, name: str) -> None:
        """The server does not hold adapter `name`: it restarted, or a fleet mate unloaded
        it (this actor lags). Load the newest adapter the server's record names (or, with
        none later, this actor's own) and name it from now on, once for all the turns that
        noticed; the turns keep this actor's version as their tag."""
        async with self._restoring:
            pushed = self._pushed
            if pushed is None or pushed[2] != name:  # a newer push replaced it
                return
            version, folder = pushed[0], pushed[1]
            created_at, held = self._pushed_created_at, self._record.read()
            if held is not None and held["created_at"] >= created_at:
                later = self._shared(held["version"], held["digest"])
                if (later / ADAPTER_FILE).is_file():
                    folder, name = later, self._adapter_name(held["version"], held["digest"])
                    created_at = held["created_at"]
            log.warning("the server does not hold this actor's adapter: loading %s", name)
            assert self._client is not None
            reply = await self._push_adapter(self._client, folder, name, created_at)
            if isinstance(reply, dict) and reply.get("success") is False:
                raise RemoteError(f"the server refused adapter {name} again: {str(reply)[:300]}")
            if self._pushed is pushed:  # a push from the reload thread meanwhile wins
                self._pushed = (version, folder, name)

    async def _call(
        self,
        client: aiohttp.ClientSession,
        method: str,
        path: str,
        body: dict | None,
        *,
        json_only: bool = True,
    ) -> Any:
        """The reply's JSON (not `json_only`: or its text); asked again with backoff while
        the server is unreachable or busy, for `timeout_s`; `RemoteError` on a refusal, a
        non-JSON reply or the deadline."""
        url, timeout_s = f"{self.url}{path}", self.cfg.timeout_s
        shown = f"{self._shown_url}{path}"
        deadline = time.monotonic() + timeout_s
        delay, last = 0.25, ""
        while True:
            try:
                async with client.request(method, url, json=body) as resp:
                    status, text = resp.status, await resp.text()
            except (TimeoutError, aiohttp.ClientError) as err:
                last = f"{type(err).__name__}: {err}"
            else:
                if status == 200:
                    try:
                        return json.loads(text)
                    except ValueError:
                        if not json_only:
                            return text
                        raise RemoteError(f"{shown}: the reply is not JSON: {text[:200]}") from None
                last = f"HTTP {status}: {text[:300]}"
                if status not in _RETRY_STATUS:
                    raise RemoteError(f"{shown}: {last}", status=status)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RemoteError(
                    f"{shown}: no answer within actor.remote.timeout_s={timeout_s:g}s ({last})"
                )
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, _MAX_BACKOFF_S)
