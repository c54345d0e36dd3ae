"""The run in the object store: the only channel between actors and the learner.

store.py       `ObjectStore` (file:// or gs://): atomic writes, compare-and-swap, retries
layout.py      `RunLayout`: every key of a run
runs.py        config.json, the DONE marker, quarantine moves
shards.py      shard format v1 and `ShardWriter`; `validation.py`: why a shard is refused
weights.py     snapshots + the `LATEST` pointer; `lease.py`: the single-learner lease
metrics.py     JSON-lines metrics, the incremental reader, `Stopwatch`
"""
