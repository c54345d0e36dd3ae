"""CLI commands that run processes of a training run (actor, learner, train, report, eval).

Kept apart from `cli.py` so `tunix-tasks inspect` never imports JAX.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_commands(
    sub: argparse._SubParsersAction,
    add_config_args: Callable[[argparse.ArgumentParser], None],
    commands: dict[str, Callable[[argparse.Namespace], int]],
) -> None:
    return None
