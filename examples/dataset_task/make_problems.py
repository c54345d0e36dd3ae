"""Write problems.jsonl: grade-school arithmetic word problems shaped like GSM8K.

Each row has the fields a GSM8K user maps with env.kwargs:
  question    the word problem
  solution    a worked solution ending "#### <answer>" (GSM8K's own `answer` format)
  answer      the final number alone
  expression  an integer expression (+ - * //) of the answer: what the calculator variant's
              demonstration passes to the `calculate` tool

Deterministic (random.Random(SEED)), no download: rerunning rewrites the same file.
    python examples/dataset_task/make_problems.py            # 300 rows beside this script
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

SEED = 0
N_ROWS = 300
NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jon"]
ITEMS = ["stickers", "marbles", "apples", "cards", "shells", "stamps"]

# A template draws its numbers and returns (question, worked steps, expression).
Template = Callable[[random.Random], tuple[str, list[str], str]]


def packs(r: random.Random) -> tuple[str, list[str], str]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b, c = r.randint(3, 40), r.randint(2, 9), r.randint(2, 12)
    q = (
        f"{name} has {a} {item}. {name} buys {b} packs of {c} {item} each. "
        f"How many {item} does {name} have now?"
    )
    return q, [f"{b} * {c} = {b * c}", f"{a} + {b * c} = {a + b * c}"], f"{a}+{b}*{c}"


def bakery(r: random.Random) -> tuple[str, list[str], str]:
    a, b = r.randint(2, 9), r.randint(6, 24)
    c = r.randint(1, a * b - 1)
    q = f"A baker makes {a} trays of {b} muffins and sells {c} muffins. How many muffins are left?"
    return q, [f"{a} * {b} = {a * b}", f"{a * b} - {c} = {a * b - c}"], f"{a}*{b}-{c}"


def wages(r: random.Random) -> tuple[str, list[str], str]:
    name = r.choice(NAMES)
    a, b, c = r.randint(8, 25), r.randint(2, 8), r.randint(2, 6)
    q = f"{name} earns ${a} an hour and works {b} hours a day for {c} days. How much does {name} earn?"
    return q, [f"{a} * {b} = {a * b}", f"{a * b} * {c} = {a * b * c}"], f"{a}*{b}*{c}"


def groups(r: random.Random) -> tuple[str, list[str], str]:
    b, k = r.randint(2, 9), r.randint(3, 15)
    a = b * k
    q = f"{a} students are split equally into {b} groups. How many students are in each group?"
    return q, [f"{a} / {b} = {k}"], f"{a}//{b}"


def legs(r: random.Random) -> tuple[str, list[str], str]:
    a, b = r.randint(2, 30), r.randint(1, 20)
    q = f"A farm has {a} chickens and {b} cows. How many legs do the animals have in total?"
    steps = [f"{a} * 2 = {2 * a}", f"{b} * 4 = {4 * b}", f"{2 * a} + {4 * b} = {2 * a + 4 * b}"]
    return q, steps, f"{a}*2+{b}*4"


def reading(r: random.Random) -> tuple[str, list[str], str]:
    name = r.choice(NAMES)
    a, c = r.randint(5, 30), r.randint(2, 9)
    b = a * c + r.randint(1, 200)
    q = (
        f"{name}'s book has {b} pages. {name} reads {a} pages a day. "
        f"How many pages are left after {c} days?"
    )
    return q, [f"{a} * {c} = {a * c}", f"{b} - {a * c} = {b - a * c}"], f"{b}-{a}*{c}"


def tickets(r: random.Random) -> tuple[str, list[str], str]:
    a, b = r.randint(8, 20), r.randint(3, 7)
    c, d = r.randint(1, 6), r.randint(1, 8)
    q = (
        f"Tickets cost ${a} for adults and ${b} for children. "
        f"How much do {c} adults and {d} children pay?"
    )
    steps = [f"{c} * {a} = {a * c}", f"{d} * {b} = {b * d}", f"{a * c} + {b * d} = {a * c + b * d}"]
    return q, steps, f"{c}*{a}+{d}*{b}"


def savings(r: random.Random) -> tuple[str, list[str], str]:
    name = r.choice(NAMES)
    a, b, c = r.randint(10, 90), r.randint(3, 15), r.randint(2, 10)
    q = f"{name} has ${a} and saves ${b} every week. How much does {name} have after {c} weeks?"
    return q, [f"{b} * {c} = {b * c}", f"{a} + {b * c} = {a + b * c}"], f"{a}+{b}*{c}"


TEMPLATES: list[Template] = [packs, bakery, wages, groups, legs, reading, tickets, savings]


def rows(n: int = N_ROWS, seed: int = SEED) -> list[dict[str, str | int]]:
    r = random.Random(seed)
    out = []
    for i in range(n):
        question, steps, expression = TEMPLATES[i % len(TEMPLATES)](r)
        answer = int(steps[-1].rsplit("= ", 1)[1])
        solution = "\n".join([*steps, f"#### {answer}"])
        out.append(
            {"question": question, "solution": solution, "answer": answer, "expression": expression}
        )
    return out


def main(path: Path = Path(__file__).with_name("problems.jsonl")) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    print(f"wrote {N_ROWS} rows to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
