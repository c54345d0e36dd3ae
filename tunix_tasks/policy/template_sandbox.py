"""The jinja sandbox chat templates render in, held to a time and size budget per render.

A chat template comes with a checkpoint, so it is untrusted code. jinja's
`ImmutableSandboxedEnvironment` keeps it from Python's internals but not from hanging a
process (nested `range(100000)` loops) or allocating gigabytes (`('a' * 100000000) * 40`).
`BoundedEnvironment` adds, without threads or signals:

- time: every loop iteration, call, filter, operator and output chunk checks the render's
  deadline (`RENDER_SECONDS`), so a render stops within the budget plus one step;
- size: operators that build strings or lists (`*`, `+`, `%`, `~`, `**` on ints), joins,
  string conversions and `format` widths have their result's size predicted before it is
  built; the text a render writes (`RENDER_CHARS`) and everything its operations build
  (`CREATED_CHARS`) are capped; an int argument to a call or filter is at most
  `MAX_ARGUMENT` (jinja's own bound on `range`), which bounds `ljust`, `center`, `indent`...;
- recursion: a macro or loop that calls itself without end is one line, not a traceback.

Every overrun is a `ChatTemplateError` naming the bound.

    env = BoundedEnvironment(seconds=2.0, chars=4 << 20)
    text = env.from_string(source).render(messages=[...])   # ChatTemplateError on overrun
"""

from __future__ import annotations

import contextvars
import functools
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.visitor

__all__ = [
    "CREATED_CHARS_FACTOR",
    "MAX_ARGUMENT",
    "RENDER_CHARS",
    "RENDER_SECONDS",
    "BoundedEnvironment",
    "ChatTemplateError",
    "RenderBudget",
]

# Real templates render a conversation in milliseconds; 2 s leaves room for a loaded
# machine and long conversations, and is what a hostile template can cost per render.
RENDER_SECONDS = 2.0
# Text one render may write: 4 Mi characters, ~8x the text of a 128k-token context.
RENDER_CHARS = 4 << 20
# What a render's operations may build in all, as a multiple of the text it may write:
# templates build each turn a few times over (`'<|im_start|>' + role + ...`).
CREATED_CHARS_FACTOR = 16
# The largest int argument to a call or filter (widths, counts): jinja's own MAX_RANGE.
MAX_ARGUMENT = jinja2.sandbox.MAX_RANGE
_BIG_INT_BITS = 1 << 16  # `**` on ints: a result of at most 65,536 bits (~20,000 digits)


class ChatTemplateError(ValueError):
    """A chat template that cannot be used here, or that raised while rendering."""


class RenderBudget:
    """What one render may still spend: its deadline and the characters it builds."""

    def __init__(self, seconds: float, chars: int) -> None:
        self.seconds, self.chars = seconds, chars
        self.max_created = CREATED_CHARS_FACTOR * chars
        self._deadline = time.monotonic() + seconds
        self._created = 0

    def tick(self) -> None:
        if time.monotonic() > self._deadline:
            raise ChatTemplateError(
                f"chat template: rendering took over {self.seconds:g} s (the budget of one render)"
            )

    def create(self, chars: int, what: str) -> None:
        """Account for `chars` characters (or items) about to be built by `what`."""
        self.tick()
        self._created += chars
        if chars > self.max_created or self._created > self.max_created:
            raise ChatTemplateError(
                f"chat template: {what} would build {chars} characters, over the budget of "
                f"{self.max_created} built in one render"
            )


_BUDGET: contextvars.ContextVar[RenderBudget] = contextvars.ContextVar("template_budget")


def _budget() -> RenderBudget:
    """The running render's budget; outside `render` (e.g. `generate`), a fresh one, so
    the size bounds hold there too."""
    budget = _BUDGET.get(None)
    return budget if budget is not None else RenderBudget(RENDER_SECONDS, RENDER_CHARS)


def text_size(value: Any, limit: int) -> int:
    """About how many characters `str(value)` has, counted without building it; counting
    stops once past `limit` (so a huge or cyclic structure costs at most `limit` steps)."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            total += 2 + 4 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            total += 2 + 2 * len(item)
            stack.extend(item)
        else:
            total += 24  # numbers, None, booleans: `**` keeps ints short
    return total


def _check_argument(value: Any, what: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_ARGUMENT:
        raise ChatTemplateError(
            f"chat template: argument {value} to {what} is over the bound {MAX_ARGUMENT}"
        )


def _check_arguments(args: Iterable[Any], kwargs: Mapping[str, Any], what: str) -> None:
    for value in [*args, *kwargs.values()]:
        _check_argument(value, what)


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _format_size(fmt: str, style: str, values: Iterable[Any], what: str) -> int:
    """The size of formatting `values` into `fmt` (`style` "{}": str.format, "%": the `%`
    operator and the `format` filter), at most: each field as large as the largest value.
    Widths and precisions (and `*` widths from the values) are at most MAX_ARGUMENT."""
    if style == "{}":
        specs = [spec for _, field, spec, _ in string.Formatter().parse(fmt) if field is not None]
    else:
        specs = [m.group(0) for m in _PERCENT_SPEC.finditer(fmt)]
    values = list(values)
    for spec in specs:
        for number in re.findall(r"\d+", spec):
            _check_argument(int(number), what)
        if "*" in spec:
            _check_arguments(values, {}, what)
    limit = RENDER_CHARS * CREATED_CHARS_FACTOR
    largest = max((text_size(v, limit) for v in values), default=0)
    return len(fmt) + len(specs) * max(largest, 24)


def _format_values(right: Any) -> list[Any]:
    """The values `fmt % right` formats: a tuple's items, a mapping's values, or `right`."""
    if isinstance(right, tuple):
        return list(right)
    if isinstance(right, Mapping):
        return list(right.values())
    return [right]


def _predicted_binop(operator: str, left: Any, right: Any) -> int:
    """The size of `left <operator> right`'s result if it is a string or sequence, else 0."""
    sequence = (str, list, tuple)
    if operator == "*":
        if isinstance(left, int) and isinstance(right, sequence):
            left, right = right, left
        if isinstance(left, sequence) and isinstance(right, int):
            return len(left) * max(right, 0)
    elif operator == "+" and isinstance(left, sequence) and isinstance(right, sequence):
        return len(left) + len(right)
    elif operator == "%" and isinstance(left, str):
        return _format_size(left, "%", _format_values(right), "%")
    elif operator == "**" and _big_power(left, right):
        raise ChatTemplateError(f"chat template: {left} ** {right} has over {_BIG_INT_BITS} bits")
    return 0


def _big_power(base: Any, exponent: Any) -> bool:
    ints = isinstance(base, int) and isinstance(exponent, int)
    return ints and abs(base) > 1 and exponent > 0 and exponent * base.bit_length() > _BIG_INT_BITS


def _join_size(items: Any, separator: str) -> int:
    items = list(items)
    limit = RENDER_CHARS * CREATED_CHARS_FACTOR
    return len(separator) * len(items) + sum(text_size(i, limit) for i in items)


def _replace_size(text: str, old: str, new: str, count: int = -1) -> int:
    hits = text.count(old) if old else len(text) + 1
    hits = hits if count < 0 else min(hits, count)
    return len(text) + hits * max(len(new) - len(old), 0)


def _str_method_size(method: Any, args: tuple[Any, ...]) -> int:
    """The size of a str method's result, for those that can build much more than their
    receiver from small arguments (every int argument is bounded already)."""
    receiver, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(receiver, str):
        return 0
    if name == "join" and args:
        return _join_size(args[0], receiver)
    if name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        count = args[2] if len(args) > 2 and isinstance(args[2], int) else -1
        return _replace_size(receiver, args[0], args[1], count)
    if name == "expandtabs":
        return len(receiver) * (args[0] if args and isinstance(args[0], int) else 8)
    return 0


def _filter_size(name: str, value: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """The size a builtin filter's result will have, for those that can build much more
    than their input (every int argument is bounded already)."""
    limit = RENDER_CHARS * CREATED_CHARS_FACTOR
    if name == "join":
        separator = args[0] if args and isinstance(args[0], str) else kwargs.get("d", "")
        return _join_size(value, str(separator))
    if name in ("string", "tojson", "pprint", "list", "e", "escape", "forceescape", "urlencode"):
        return text_size(value, limit) * (6 if "escape" in name or name == "e" else 1)
    if name == "replace" and isinstance(value, str) and len(args) >= 2:
        count = args[2] if len(args) > 2 and isinstance(args[2], int) else -1
        return _replace_size(value, str(args[0]), str(args[1]), count)
    if name == "format" and isinstance(value, str):  # `value % (kwargs or args)`
        return _format_size(value, "%", [*args, *kwargs.values()], "format")
    if name == "indent" and isinstance(value, str):
        width = args[0] if args else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else int(width)
        return len(value) + (value.count("\n") + 1) * width
    return 0


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` with its arguments bounded and its result's size accounted; keeps
    jinja's `pass_context`-style marker (functools.wraps copies it)."""
    skip = 2 if hasattr(function, "jinja_pass_arg") else 1  # (context,) value, args...

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        _check_arguments(args[skip:], kwargs, f"filter {name}")
        value = args[skip - 1] if len(args) >= skip else None
        budget.create(_filter_size(name, value, args[skip:], kwargs), f"filter {name}")
        result = function(*args, **kwargs)
        if isinstance(result, str | list):
            budget.create(len(result), f"filter {name}")
        return result

    return bounded


def _iterate(iterable: Any) -> Iterator[Any]:
    """A `for` loop's iterable, checking the deadline at every iteration."""
    budget = _budget()
    for item in iterable:
        budget.tick()
        yield item


def _concat(parts: list[Any]) -> str:
    """The `~` operator: jinja's `str_join`, its size predicted first."""
    _budget().create(_join_size(parts, ""), "~")
    return "".join(map(str, parts))


class _RouteThroughBudget(jinja2.visitor.NodeTransformer):
    """Rewrites every `for` iterable and `~` concatenation into a call to the budgeted
    helpers (jinja gives no hook for either)."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        node = self.generic_visit(node)
        node.iter = jinja2.nodes.Filter(
            node.iter, "_budget_iterate", [], [], None, None, lineno=node.lineno
        )
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        node = self.generic_visit(node)
        parts = jinja2.nodes.List(node.nodes, lineno=node.lineno)
        return jinja2.nodes.Filter(parts, "_budget_concat", [], [], None, None, lineno=node.lineno)


class BoundedTemplate(jinja2.Template):
    """A template whose `render` runs under its environment's budget."""

    environment: BoundedEnvironment

    def render(self, *args: Any, **kwargs: Any) -> str:
        env = self.environment
        budget = RenderBudget(env.render_seconds, env.render_chars)
        token = _BUDGET.set(budget)
        try:
            out, size = [], 0
            for chunk in self.generate(*args, **kwargs):
                size += len(chunk)
                if size > budget.chars:
                    raise ChatTemplateError(
                        f"chat template: rendering wrote over {budget.chars} characters "
                        "(the budget of one render)"
                    )
                budget.tick()
                out.append(chunk)
            return "".join(out)
        except RecursionError:
            raise ChatTemplateError(
                "chat template: recursion too deep (a macro or loop that calls itself without end)"
            ) from None
        finally:
            _BUDGET.reset(token)


class BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every render held to `seconds` and `chars` (module doc)."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})
    template_class = BoundedTemplate

    def __init__(
        self, *, seconds: float = RENDER_SECONDS, chars: int = RENDER_CHARS, **options: Any
    ) -> None:
        extensions = [jinja2.ext.loopcontrols, *options.pop("extensions", [])]
        super().__init__(extensions=extensions, finalize=self._finalize, **options)
        self.render_seconds, self.render_chars = seconds, chars
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters["_budget_iterate"] = _iterate
        self.filters["_budget_concat"] = _concat

    def add_filter(self, name: str, function: Callable[..., Any]) -> None:
        """Register a filter, bounded like the builtins."""
        self.filters[name] = _bounded_filter(name, function)

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        # Where jinja parses every source (from_string, get_template): rewrite it there.
        return _RouteThroughBudget().visit(super()._parse(source, name, filename))

    @staticmethod
    def _finalize(value: Any) -> Any:
        """Every `{{ value }}`: its text's size counted before it is built."""
        budget = _budget()
        budget.create(text_size(value, budget.max_created), "output")
        return value

    def call_binop(
        self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any
    ) -> Any:
        _budget().create(_predicted_binop(operator, left, right), operator)
        return super().call_binop(context, operator, left, right)

    def call(
        __self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any
    ) -> Any:
        budget = _budget()
        what = getattr(__obj, "__name__", type(__obj).__name__)
        budget.tick()
        _check_arguments(args, kwargs, what)
        budget.create(_str_method_size(__obj, args), what)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, str | list):
            budget.create(len(result), what)
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """`str.format` / `format_map`, their result's size predicted first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt, name = value.__self__, value.__name__

        @functools.wraps(wrapped)
        def bounded(*args: Any, **kwargs: Any) -> str:
            values = [*args, *kwargs.values()]
            if name == "format_map" and args and isinstance(args[0], Mapping):
                values = list(args[0].values())
            _budget().create(_format_size(fmt, "{}", values, name), name)
            return wrapped(*args, **kwargs)

        return bounded
