"""`actor.remote`: an async actor's turns sampled by an OpenAI-compatible completions server
(vLLM, SGLang, or `tunix-tasks serve` on an accelerator) instead of its own JAX sampler
(docs/remote-engine.md):

wire.py    the contract: token ids in, token ids and log-probs out (`/v1/completions`), a
           weights folder loaded by path (`/update_weights_from_disk`); `RemoteError`
engine.py  `RemoteEngine`: the actor's rollout engine and policy over that server; pushes
           each new snapshot as a Hugging Face checkpoint folder
shared_disk.py  what a run's actors coordinate through on the shared `weights_dir`: claims
           (taken over when stale) and each server's record of what it holds
server.py  `tunix-tasks serve`: the run's batched sampler behind the same contract
"""
