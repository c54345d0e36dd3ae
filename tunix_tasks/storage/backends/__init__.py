"""Object-store backends: one module per URI scheme, each a class implementing
`ObjectStore` (`storage/store.py`), registered by scheme in `storage/uri.py` and imported
by the first `open_store` of that scheme.

local.py            `LocalStore` (file://): a directory; CAS by link(2) of generation files
local_tempfiles.py  the local store's temp files, and collecting those killed writers left
local_listing.py    the local store's listing from a position (skips folders before it)
gcs.py              `GcsStore` (gs://): the only module importing google-cloud-storage

A new scheme (say s3://): a module here with its class, and one `register_backend` line
in `storage/uri.py` (or, from another package, an entry point in `tunix_tasks.stores`);
docs/architecture.md has the recipe.
"""
