"""`actor.kind: agent`: any agent program trains through an OpenAI-compatible endpoint.

The endpoint serves `POST /v1/chat/completions` and `GET /v1/models` per episode
(`/episodes/<id>/v1`) from the actor's continuously batched sampler, and records every
turn token in / token out, so a closed episode is an `Episode` like the other kinds'
(docs/agents.md):

wire.py      the OpenAI wire format: `ChatRequest` (validated), the `chat.completion`
             response, `ApiError` (OpenAI error bodies)
fidelity.py  `match_history`: does the client's conversation extend the episode's? (pure)
episodes.py  `EpisodeRegistry`: open / close / drop episodes, their groups, the sweep of
             abandoned ones
service.py   `EndpointService`: one request: match, render the new messages, sample, record
tool_choice.py `tool_choice` enforced by the template's forced tool-call opening (prompt
             tokens, not trained) or the turn returned as text
server.py    `build_app` (Starlette routes, errors, bearer token, body bound) and
             `EndpointServer` (uvicorn on the actor's event loop)
runner.py    `AgentRunner`: copies of the user's `run(client, task)` against the endpoint (one
             whose episode is dropped meanwhile is cancelled)
actor.py     `AgentActor`: the async actor with the endpoint and the runner as its loop
evaluation.py `play_program`: the program scored on held-out seeds on a private endpoint
             (what `tunix-tasks eval` runs for an agent run)
"""
