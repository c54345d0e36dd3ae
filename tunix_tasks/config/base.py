"""The base every config model shares, and the errors and warnings of loading one.

`Frozen` models are immutable, reject unknown fields and validate on construction (the
defaults too), so a config that exists is a valid one. `Int`, `Float` and `FloatOrNone`
are the number types of every config field: pydantic's usual coercions (a YAML int for a
float field, a numeric string such as `--set`'s `3e-4`), except that a boolean is not a
number (`max_steps: true` is refused, not read as 1).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

__all__ = ["ConfigError", "ConfigWarning", "Float", "FloatOrNone", "Frozen", "Int"]


def _not_a_boolean(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("Input should be a number, not a boolean")
    return value


Int = Annotated[int, BeforeValidator(_not_a_boolean)]
Float = Annotated[float, BeforeValidator(_not_a_boolean)]
#: An optional `Float` (not `Float | None`, whose bounds the JSON schema would misspell).
FloatOrNone = Annotated[float | None, BeforeValidator(_not_a_boolean)]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the valid values."""


class ConfigWarning(UserWarning):
    """A configuration is valid but probably not what was meant (`RunConfig.warnings`)."""
