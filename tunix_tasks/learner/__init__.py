"""The learner, in data-flow order.

source.py      shards -> validated `EpisodeBlock`s with advantages (`advantages.py`); the position
blocks.py      `EpisodeBlock`: one shard's unacknowledged rows as columns, the buffer's unit
flow.py        `AsyncFlow` / `SyncFlow`: ready? drop masks (per `DropReason`)? publish?
staleness.py   `learner_version - policy_version`, the one formula, and its metric buckets
batcher.py     the buffer: drop what the flow rejects (masks), pack one batch
packing.py     bucket shapes, first-fit packing (pure numpy)
objective/     off-policy corrections as a registry, `policy_loss`; `rl_math.py`: their maths
train_step.py  mesh, sharded params/optimizer, the jitted update
master_copy.py bf16 params: the optimizer on a float32 master copy of them
accounting.py  exactly-once acknowledgement and the ledger; `checkpoint.py`: orbax
drop_bias.py   length, turns and reward of stale drops vs trained episodes (pure numpy)
publishing.py  background, coalesced weight snapshots; `startup.py`: start, restore, warm start
warm_start.py  supervised steps on the run's demonstration shards, before RL
learner.py     the loop: next batch -> dispatch -> acknowledge -> publish/checkpoint
multihost.py   P processes, one mesh: process 0 leads and announces; the rest follow
"""
