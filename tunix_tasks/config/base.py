"""The base every config model shares, and the errors and warnings of loading one.

`Frozen` models are immutable, reject unknown fields and validate on construction (the
defaults too), so a config that exists is a valid one.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigError", "ConfigWarning", "Frozen"]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the valid values."""


class ConfigWarning(UserWarning):
    """A configuration is valid but probably not what was meant (`RunConfig.warnings`)."""
