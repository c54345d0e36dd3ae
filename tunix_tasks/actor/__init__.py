"""Actors: play many environments with the current policy, write shards. One folder per
actor kind (`actor.kind`), the runtime and the records they share beside them:

runtime.py         `ActorRuntime`: lifecycle and stop rules, weights reload, shards, metrics
engine.py          `RolloutEngine`: what the runtime asks of a kind's engine (its call loop)
episodes.py        `EpisodeBuilder`: the one place an `Episode` is assembled (field meanings)
admission.py       flow control: `admission` (pure: admit or pause) and `AdmissionGate` (I/O)
demonstrations.py  expert episodes for the learner's warm start (`demos/` shards)
asynchronous/      `actor.kind: async`: asyncio environments, the batched `Sampler`
vectorized/        `actor.kind: vectorized`: JAX environments and the policy in one jitted loop
endpoint/          `actor.kind: agent`: an agent program through an OpenAI-compatible endpoint
remote/            `actor.remote`: the async kind's turns from a completions server (vLLM,
                   SGLang, `tunix-tasks serve`), its weights pushed there

A new actor engine is a new folder here: an engine satisfying `RolloutEngine` and an
`ActorRuntime` subclass (`_build_engine`, `_serve`), registered under its `actor.kind`
in `frontdoor/entrypoints.py: ACTOR_KINDS` and `config.py: ActorConfig.kind`
(docs/architecture.md, "A new actor engine").
"""
