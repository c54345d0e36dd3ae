"""Argument types the benchmarks' command lines share: comma-separated lists.

p.add_argument("--seeds", type=ints)                        # "0,1,2" -> [0, 1, 2]
p.add_argument("--modes", type=one_of(("sync", "async")))   # unknown names: a usage error
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def one_of(valid: Sequence[str]) -> Callable[[str], list[str]]:
    """A comma-separated list of names from `valid`; others are an argparse error naming them."""

    def parse(text: str) -> list[str]:
        items = [x for x in text.split(",") if x]
        bad = [x for x in items if x not in valid]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; valid: {tuple(valid)}")
        return items

    return parse
