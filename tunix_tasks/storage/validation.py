"""Shard validation: every reason a shard may not be trained on, as one typed error.

The learner quarantines a shard that raises `ShardValidationError`; the error names the
shard and the reason. Checks are vectorised over Arrow buffers, so validating costs a
small fraction of decoding.

    table = read_shard(store, "shards/actor-0/....parquet", vocab_size=103)
    read_shard(store, key, vocab_size=103, max_length=192, max_version=7)  # learner limits
    columns = read_shard_columns(store, key, vocab_size=103)  # the checked numpy columns
    # the learner's rounds: decode in reader threads, then check all at once
    tables = [read_shard_table(store, k, max_length=192) for k in keys]
    valid = validate_tables(tables, keys, vocab_size=103, max_length=192, max_version=7)

`max_length` (the longest episode the run allows, `actor.max_episode_tokens`) rejects a
shard as `too_long`; `max_version` (the newest weights version the learner has
published) rejects one whose `policy_version` is from the future as `future_version`; a
reward outside [-1e6, 1e6] (`episode.MAX_ABS_REWARD`) is `reward_out_of_range`; `run_id`
(the run's, `storage.runs.run_id`) rejects a shard an actor of another incarnation of the
run wrote (its `tunix.run_id` metadata: the run was deleted and created again under its
URI while that actor ran) as `other_run`.

Size bounds come before decoding: the Parquet footer's declared sizes (each row group's
uncompressed bytes, the `tokens` values each row group declares, the `length` column's
statistics) are checked against `max_bytes` and `max_length` first, so a 26 KB file that
declares one 60 M-token episode is refused without decoding it. Decoding then goes one row
group at a time with strings read as dictionaries, and the decoded bytes, strings counted
expanded, are summed against `max_bytes` (`MAX_SHARD_BYTES`) before the next row group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, TypedDict, Unpack

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tunix_tasks.episode import MAX_ABS_REWARD, EpisodeStatus
from tunix_tasks.storage.shards import (
    RUN_ID_KEY,
    SCHEMA_VERSION,
    SHARD_SCHEMA,
    ShardColumns,
    row_columns,
)
from tunix_tasks.storage.store import NotFound, ObjectStore
from tunix_tasks.storage.uri import join_uri

# Decoded bytes one shard may hold: 32x the 8 MiB at which a `ShardWriter` commits, so an
# honest shard (at most one group over that) never comes near it, while the learner, which
# holds at most `source.CHECK_EVERY` = 16 decoded shards at once, stays under 4 GiB
# whatever the files declare.
MAX_SHARD_BYTES = 256 << 20
_VERSION_KEY = b"tunix.schema_version"
_STRINGS = [f.name for f in SHARD_SCHEMA if pa.types.is_string(f.type)]


class ShardValidationError(ValueError):
    """A shard is unreadable or breaks the v1 contract. `reason` is a short code."""

    def __init__(self, where: str, reason: str, detail: str) -> None:
        super().__init__(f"{where}: {reason}: {detail}")
        self.where = where
        self.reason = reason
        self.detail = detail


class ShardLimits(TypedDict, total=False):
    """The learner's bounds on a shard (module docstring): `max_length` tokens per
    episode, `max_version` the newest published version, `max_bytes` decoded, `run_id`
    the run's id ("" or absent: any writer's shards)."""

    max_length: int | None
    max_version: int | None
    max_bytes: int
    run_id: str


def read_shard(
    store: ObjectStore, key: str, *, vocab_size: int, **limits: Unpack[ShardLimits]
) -> pa.Table:
    """Read and validate one shard; raises ShardValidationError (or NotFound)."""
    return _read(store, key, vocab_size, **limits)[0]


def read_shard_columns(
    store: ObjectStore, key: str, *, vocab_size: int, **limits: Unpack[ShardLimits]
) -> ShardColumns:
    """`read_shard`, as the numpy columns the checks ran on (what the learner buffers)."""
    return _read(store, key, vocab_size, **limits)[1]


def read_shard_table(
    store: ObjectStore,
    key: str,
    *,
    max_length: int | None = None,
    max_bytes: int = MAX_SHARD_BYTES,
    run_id: str = "",
) -> pa.Table:
    """A shard's rows decoded within the size bounds (module docstring), not yet validated
    (`validate_table` / `validate_tables`), strings still dictionary-encoded: the part of
    reading that releases the GIL, for a reader thread. Raises ShardValidationError (or
    NotFound)."""
    where = join_uri(store.uri, key)
    try:
        source = store.open_input(key)
        # ParquetFile skips the dataset layer of read_table: same result, less overhead.
        file = pq.ParquetFile(source, read_dictionary=_STRINGS)
        _check_writer(file, where, run_id)
        _check_declared(file, where, max_length, max_bytes)
        return _decode(file, where, max_bytes)
    except (NotFound, ShardValidationError):
        raise
    except (pa.ArrowException, OSError, ValueError) as err:
        raise ShardValidationError(
            where, "corrupt", f"not a readable Parquet file ({err})"
        ) from None


def _read(
    store: ObjectStore,
    key: str,
    vocab_size: int,
    max_length: int | None = None,
    max_version: int | None = None,
    max_bytes: int = MAX_SHARD_BYTES,
    run_id: str = "",
) -> tuple[pa.Table, ShardColumns]:
    table = read_shard_table(store, key, max_length=max_length, max_bytes=max_bytes, run_id=run_id)
    table = _plain_strings(table)
    columns = validate_table(
        table,
        where=join_uri(store.uri, key),
        vocab_size=vocab_size,
        max_length=max_length,
        max_version=max_version,
    )
    return table, columns


class ValidShards(NamedTuple):
    """`validate_tables`' answer: shard i's columns, or None and `errors[i]` says why it
    is invalid."""

    columns: list[ShardColumns | None]
    errors: list[ShardValidationError | None]


def validate_tables(
    tables: Sequence[pa.Table],
    wheres: Sequence[str],
    *,
    vocab_size: int,
    max_length: int | None = None,
    max_version: int | None = None,
) -> ValidShards:
    """`validate_table` of several shards (`read_shard_table`'s tables; `wheres` name
    them) in one vectorised pass over all their rows (`check_table`), so a round of
    shards costs the Python work of about one: per shard, that work holds the GIL about
    as long as the decoding does (#29). Every check holds for all rows only if it holds
    for each shard's (episode ids unique over all of them is stricter), so when the pass
    fails, or the shards differ in schema or one is empty, they are checked one by one,
    which names each invalid shard. Each shard's columns are views of its own table."""
    checks: dict[str, Any] = {
        "vocab_size": vocab_size,
        "max_length": max_length,
        "max_version": max_version,
    }
    sizes = [t.num_rows for t in tables]
    schema = tables[0].schema if tables else None
    # Each shard's metadata differs (its length histogram); their schema versions may not.
    versions = {(t.schema.metadata or {}).get(_VERSION_KEY) for t in tables}
    if (
        tables
        and all(sizes)
        and len(versions) <= 1
        and all(t.schema.equals(schema) for t in tables)
    ):
        try:
            rows = check_table(pa.concat_tables(tables), where="", **checks)
        except (ShardValidationError, pa.ArrowInvalid):  # (or over 2^31 list values in all)
            pass  # which shards, and why: one by one, below
        else:
            starts = np.cumsum([0, *sizes])
            return ValidShards(
                [
                    ShardColumns.of(t, {k: v[a:b] for k, v in rows.items()})
                    for t, a, b in zip(tables, starts[:-1], starts[1:], strict=True)
                ],
                [None] * len(tables),
            )
    columns: list[ShardColumns | None] = []
    errors: list[ShardValidationError | None] = []
    for table, where in zip(tables, wheres, strict=True):
        try:
            columns.append(validate_table(table, where=where, **checks))
            errors.append(None)
        except ShardValidationError as err:
            columns.append(None)
            errors.append(err)
    return ValidShards(columns, errors)


def _too_large(where: str, size: int, max_bytes: int, what: str) -> ShardValidationError:
    return ShardValidationError(
        where, "too_large", f"{what} {size} bytes, over the limit of {max_bytes} bytes per shard"
    )


def _check_writer(file: pq.ParquetFile, where: str, run_id: str) -> None:
    """Refuse a shard written by an actor of another incarnation of the run (module
    docstring); one that names none (older actors, other writers) is any run's."""
    written = (file.schema_arrow.metadata or {}).get(RUN_ID_KEY.encode())
    if run_id and written is not None and written != run_id.encode():
        raise ShardValidationError(
            where,
            "other_run",
            f"written by an actor of run_id {written[:40].decode('ascii', 'replace')!r}, "
            f"not of this run's ({run_id}): the run was deleted and created again under "
            "its URI while that actor ran",
        )


def _check_declared(
    file: pq.ParquetFile, where: str, max_length: int | None, max_bytes: int
) -> None:
    """Refuse a shard from its footer alone: declared sizes, list sizes and lengths."""
    meta = file.metadata
    declared = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    if declared > max_bytes:
        raise _too_large(where, declared, max_bytes, "the file declares")
    if max_length is None:
        return
    columns = {file.schema.column(i).path: i for i in range(meta.num_columns)}
    first_row = 0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        if "tokens.list.element" in columns:
            # Leaf values (an empty list counts 1), so an honest file never exceeds this.
            values = group.column(columns["tokens.list.element"]).num_values
            if values > group.num_rows * max_length:
                raise ShardValidationError(
                    where,
                    "too_long",
                    f"row group {i} declares {values} tokens in {group.num_rows} rows, over "
                    f"the limit max_length={max_length} per row ({_LIMIT_SOURCE})",
                )
        stats = group.column(columns["length"]).statistics if "length" in columns else None
        declared_max = stats.max if stats is not None and stats.has_min_max else None
        if isinstance(declared_max, int) and declared_max > max_length:
            # Decode only this row group's `length` column to name the row.
            lengths = file.read_row_group(i, columns=["length"]).column(0).to_numpy()
            _check_lengths(lengths, where, max_length, first_row)
        first_row += group.num_rows


def _decode(file: pq.ParquetFile, where: str, max_bytes: int) -> pa.Table:
    """The file's rows, one row group at a time, stopping once `max_bytes` are decoded.
    Strings come as dictionaries (a value stored once may stand for every row), counted
    expanded; the checks read them as they are (`ShardColumns.of` expands them into
    object arrays whose rows share the dictionary's strings)."""
    parts, decoded = [], 0
    for i in range(file.num_row_groups):
        # One thread per shard: the learner reads several shards at once, and Arrow's own
        # pool on top of those threads only contends with them (measured in #29).
        part = file.read_row_group(i, use_threads=False)
        # The buffers' sizes: a bound of `nbytes` (equal for freshly decoded buffers) at
        # a 30th of its cost, which walks every array under the GIL (measured, #29).
        decoded += part.get_total_buffer_size()
        decoded += _strings_bytes(part, max_bytes - decoded)
        if decoded > max_bytes:
            raise _too_large(where, decoded, max_bytes, f"row groups 0-{i} decode to")
        parts.append(part)
    if not parts:
        return file.schema_arrow.empty_table()
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


def _plain_strings(table: pa.Table) -> pa.Table:
    """`table` with its dictionary-encoded columns expanded (the shard schema's types)."""
    for i, field in enumerate(table.schema):
        if pa.types.is_dictionary(field.type):
            plain = pa.field(field.name, field.type.value_type, field.nullable, field.metadata)
            table = table.set_column(i, plain, table.column(i).cast(plain.type))
    return table


def _strings_bytes(part: pa.Table, budget: int) -> int:
    """Bytes of `part`'s dictionary-encoded string columns once expanded (values and
    offsets), or a bound of them: each row at most its whole dictionary's bytes. The bound
    costs nothing per row and is what an honest shard (short ids, tens of rows) returns;
    the exact count runs only when the bound exceeds what is left of the shard's budget."""
    chunks = [c for col in part.columns if pa.types.is_dictionary(col.type) for c in col.chunks]
    bound = sum(len(chunk) * (chunk.dictionary.get_total_buffer_size() + 4) for chunk in chunks)
    if bound <= budget:
        return bound
    total = 0
    for chunk in chunks:
        if len(chunk.dictionary):
            sizes = pc.binary_length(chunk.dictionary).fill_null(0).to_numpy()
            indices = chunk.indices.fill_null(0).to_numpy()
            total += int(sizes[indices].sum()) + 4 * len(chunk)
    return total


def validate_table(
    table: pa.Table,
    *,
    where: str,
    vocab_size: int,
    max_length: int | None = None,
    max_version: int | None = None,
) -> ShardColumns:
    """The table's columns, or ShardValidationError if it breaks the shard v1 contract
    (reason `unreadable` when a check cannot even run on what the shard holds). String
    columns may be dictionary-encoded (`read_shard_table`'s)."""
    rows = check_table(
        table, where=where, vocab_size=vocab_size, max_length=max_length, max_version=max_version
    )
    return ShardColumns.of(table, rows)


def check_table(
    table: pa.Table,
    *,
    where: str,
    vocab_size: int,
    max_length: int | None = None,
    max_version: int | None = None,
) -> dict[str, np.ndarray]:
    """`validate_table`'s checks; returns the table's `row_columns`, which they ran on.
    The list columns are checked as Arrow arrays, chunk by chunk, never copied."""
    try:
        return _check(table, where, vocab_size, max_length, max_version)
    except ShardValidationError:
        raise
    except (pa.ArrowException, ValueError, TypeError, ArithmeticError, LookupError) as err:
        raise ShardValidationError(
            where, "unreadable", f"the checks cannot read its content ({err!r})"
        ) from None


def _check(
    table: pa.Table,
    where: str,
    vocab_size: int,
    max_length: int | None,
    max_version: int | None,
) -> dict[str, np.ndarray]:
    meta = table.schema.metadata or {}
    version = meta.get(_VERSION_KEY)
    if version is not None and version != str(SCHEMA_VERSION).encode():
        raise ShardValidationError(
            where,
            "schema_version",
            f"file has schema version {version.decode()!r}, reader supports {SCHEMA_VERSION}",
        )
    _check_schema(table, where)
    if table.num_rows == 0:
        raise ShardValidationError(where, "empty", "shard has no rows")
    for name in SHARD_SCHEMA.names:
        if _has_nulls(table.column(name)):
            raise ShardValidationError(where, "null", f"column {name!r} has null values")
    rows = row_columns(table)  # types and nulls checked: the rest runs on these
    _check_lists(table, rows["length"], where, vocab_size, max_length)
    _check_scalars(rows, where, max_version)
    return rows


def _has_nulls(column: pa.ChunkedArray) -> bool:
    """Nulls in a column, or in its lists' values, or in its dictionaries (a null there
    is a null row without being counted as one)."""
    if column.null_count:
        return True
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        return bool(pc.list_flatten(column).null_count)
    if pa.types.is_dictionary(column.type):
        return any(chunk.dictionary.null_count for chunk in column.chunks)
    return False


def _check_schema(table: pa.Table, where: str) -> None:
    names = set(table.column_names)
    missing = [f.name for f in SHARD_SCHEMA if f.name not in names]
    if missing:
        raise ShardValidationError(where, "missing_columns", f"missing columns {missing}")
    for f in SHARD_SCHEMA:
        actual = table.schema.field(f.name).type
        if pa.types.is_dictionary(actual) and pa.types.is_string(f.type):
            actual = actual.value_type  # strings as `read_shard_table` decodes them
        if not actual.equals(f.type) and not (
            # accept large_list too
            pa.types.is_list(f.type)
            and pa.types.is_large_list(actual)
            and actual.value_type.equals(f.type.value_type)
        ):
            raise ShardValidationError(
                where, "wrong_type", f"column {f.name!r} has type {actual}, expected {f.type}"
            )


def _check_lists(
    table: pa.Table, lengths: np.ndarray, where: str, vocab_size: int, max_length: int | None
) -> None:
    for name in ("tokens", "loss_mask", "behavior_logprobs"):
        n = pc.list_value_length(table.column(name)).to_numpy()
        bad = np.nonzero(n != lengths)[0]
        if bad.size:
            row = int(bad[0])
            raise ShardValidationError(
                where,
                "length_mismatch",
                f"row {row}: len({name})={int(n[row])} but length={int(lengths[row])}",
            )
    if (lengths <= 0).any():
        raise ShardValidationError(where, "empty_episode", "an episode has length 0")
    if max_length is not None:
        _check_lengths(lengths, where, max_length)
    tokens = pc.min_max(pc.list_flatten(table.column("tokens")))
    lo, hi = tokens["min"].as_py(), tokens["max"].as_py()
    if lo < 0 or hi >= vocab_size:
        raise ShardValidationError(
            where,
            "token_out_of_range",
            f"token ids span [{lo}, {hi}], vocabulary is [0, {vocab_size})",
        )
    mask = pc.min_max(pc.list_flatten(table.column("loss_mask")))
    if mask["min"].as_py() < 0 or mask["max"].as_py() > 1:
        raise ShardValidationError(where, "bad_loss_mask", "loss_mask values must be 0 or 1")
    # numpy's min and max, chunk by chunk: they propagate NaN (Arrow's skip it, and its
    # float min_max is 9x slower, measured in #29).
    highest = -math.inf
    for chunk in pc.list_flatten(table.column("behavior_logprobs")).chunks:
        values = chunk.to_numpy()
        if not values.size:
            continue
        lo, hi = float(values.min()), float(values.max())
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ShardValidationError(where, "non_finite", "behavior_logprobs has NaN or inf")
        highest = max(highest, hi)
    if highest > 1e-4:
        raise ShardValidationError(where, "bad_logprob", "behavior_logprobs must be <= 0")


_LIMIT_SOURCE = "actor.max_episode_tokens, at most model.max_seq_len"


def _check_lengths(lengths: np.ndarray, where: str, max_length: int, first_row: int = 0) -> None:
    if (lengths > max_length).any():
        row = int(np.argmax(lengths))
        raise ShardValidationError(
            where,
            "too_long",
            f"row {first_row + row}: {int(lengths[row])} tokens, over the limit "
            f"max_length={max_length} ({_LIMIT_SOURCE})",
        )


def _check_scalars(rows: dict[str, np.ndarray], where: str, max_version: int | None) -> None:
    reward = rows["reward"]
    if not np.isfinite(reward).all():
        raise ShardValidationError(where, "non_finite", "reward has NaN or inf")
    if (np.abs(reward) > MAX_ABS_REWARD).any():
        row = int(np.argmax(np.abs(reward)))
        raise ShardValidationError(
            where,
            "reward_out_of_range",
            f"row {row}: reward {float(reward[row]):g} is outside [-{MAX_ABS_REWARD:g}, "
            f"{MAX_ABS_REWARD:g}] (episode.MAX_ABS_REWARD)",
        )
    versions = rows["policy_version"]
    if (versions < 0).any():
        raise ShardValidationError(where, "bad_version", "policy_version must be >= 0")
    if max_version is not None and versions.max() > max_version:
        raise ShardValidationError(
            where,
            "future_version",
            f"policy_version {int(versions.max())} is newer than the newest version the "
            f"learner has published ({max_version})",
        )
    statuses = set(rows["status"].tolist())
    valid = [s.value for s in EpisodeStatus]
    if not statuses <= set(valid):
        raise ShardValidationError(
            where, "bad_status", f"status values {sorted(statuses - set(valid))}; valid: {valid}"
        )
    ids = rows["episode_id"]
    if len(set(ids.tolist())) != len(ids):
        raise ShardValidationError(
            where, "duplicate_episode_id", "episode_id values are not unique"
        )
