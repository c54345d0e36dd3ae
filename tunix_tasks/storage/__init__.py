"""The run in the object store: the only channel between actors and the learner.

uri.py              store URIs: the scheme -> backend table, `normalize_uri`, `join_uri`
store.py            the `ObjectStore` contract (atomic writes, compare-and-swap), its
                    errors, `open_store`
backends/           one module per scheme: `LocalStore` (file://), `GcsStore` (gs://)
outage.py           `StoreOutage`: an actor riding out a store outage without losing data
layout.py           `RunLayout`: every key of a run
runs.py             config.json, run_id and the run fence, the DONE marker, quarantine moves
shards.py           shard format v1 and `ShardWriter`
validation.py       why a shard is refused (`read_shard`)
weights.py          storing and reading snapshots, moving the `LATEST` pointer
snapshot_format.py  a snapshot as data: manifest, safetensors views, XOR deltas, the pointer
lease.py            the single-learner lease
retention.py        which weight snapshots a run keeps (pruned after each publish)
metrics.py          JSON-lines metrics, the incremental reader, `Stopwatch`
tensorboard.py      metrics as TensorBoard event files
trackers.py         metrics to the user's experiment tracker (`tracker: mlflow`), a registry
local_folder.py     a local folder written whole or not at all (imports, exports)
"""
