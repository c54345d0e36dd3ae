"""`actor.kind: async`: many asyncio environments, one continuously batched sampler.

actor.py     `Actor`: the kind's `ActorRuntime`: GRPO groups of concurrent episodes, sync mode
batching.py  `BatchingPolicy`: concurrent episodes' policy calls -> the sampler's engine thread
rollout.py   one episode's token layout and loop (`play_episode` -> `Episode`), also used by
             evaluation and the demonstrations
"""
