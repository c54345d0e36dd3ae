"""Actors: play many environments concurrently with the current policy, write shards.

actor.py           the actor process: episodes, weight reloads, stop rules, metrics
rollout.py         one episode's token layout and loop -> `Episode`
batching.py        concurrent policy calls -> one batched sampler call
demonstrations.py  expert episodes for the learner's warm start (`demos/` shards)
"""
