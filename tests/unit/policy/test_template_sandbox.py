"""Issue #30.7: a chat template is held to a time and size budget at every render.

Each hostile template here hung a process for over 60 s or allocated gigabytes before;
now each is one `ChatTemplateError` naming the bound, within the budget (0.3 s here).
"""

from __future__ import annotations

import time

import jinja2.sandbox
import pytest

from tunix_tasks.policy.chat_template import ChatTemplateError, compile_template

FAST = {"seconds": 0.3}
MESSAGES = [{"role": "user", "content": "hi"}] * 100

HOSTILE = {
    "nested range loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "rendering took over 0.3 s",
    ),
    "loops over the conversation": (
        "{% for a in messages %}{% for b in messages %}{% for c in messages %}"
        "{% for d in messages %}{% for e in messages %}{% endfor %}{% endfor %}{% endfor %}"
        "{% endfor %}{% endfor %}",
        "rendering took over 0.3 s",
    ),
    "a macro calling itself twice": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(40) }}",
        "rendering took over 0.3 s",
    ),
    "a recursive macro": (
        "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
        "recursion too deep",
    ),
    "a 4 GB string": ("{{ ('a' * 100000000) * 40 }}", "* would build 100000000 characters"),
    "doubling with ~": (
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s }}",
        "~ would build",
    ),
    "a join of one string 10^5 times": (
        "{% set s = 'a' * 100000 %}{{ ([s] * 100000) | join }}",
        "filter join would build 10000000000 characters",
    ),
    "a list printed": (
        "{% set s = 'a' * 100000 %}{{ [s] * 100000 }}",
        "output would build",
    ),
    "a format repeating one value": (
        "{% set s = 'a' * 4000000 %}{{ ('{0}' * 1000).format(s) }}",
        "format would build 4000003000 characters",
    ),
    "a % repeating one value": (
        "{% set s = 'a' * 4000000 %}{{ ('%(a)s' * 1000) % {'a': s} }}",
        "% would build 4000005000 characters",
    ),
    "a width": ("{{ 'a' | center(1000000000) }}", "argument 1000000000 to filter center"),
    "a method's width": ("{{ 'a'.ljust(1000000000) }}", "argument 1000000000 to ljust"),
    "a format width": ("{{ '{:>999999999}'.format(1) }}", "argument 999999999 to format"),
    "a % width": ("{{ '%999999999d' % 1 }}", "argument 999999999 to %"),
    "a huge power": ("{{ 2 ** 100000000 }}", "2 ** 100000000 has over 65536 bits"),
    "endless output": (
        "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}",
        "rendering wrote over 4194304 characters",
    ),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_template_is_one_clear_error_within_the_budget(name: str) -> None:
    source, message = HOSTILE[name]
    # The size bounds are tested with time to spare: a loaded machine must not trip the
    # deadline first.
    seconds = FAST["seconds"] if "took over" in message else 60.0
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="chat template: .*" + message.replace("*", r"\*")):
        compile_template(source, seconds=seconds).render(messages=MESSAGES)
    assert time.monotonic() - started < 10.0  # the budget and one step, on a loaded machine


def test_real_templates_render_unchanged_within_the_budget() -> None:
    source = (
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content ~ '<|im_end|>' }}"
        "{% if not loop.last %}\\n{% endif %}{% endfor %}{{ messages | length }}"
        "{{ '%05d' % 7 }}{{ '{:>4}'.format('x') }}{{ 'a b' | replace(' ', '_') | center(5) }}"
        "{{ '%s {' % 1 }}{{ '%s' | format('y') }}"
    )
    out = compile_template(source, **FAST).render(messages=MESSAGES[:2])
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(source)
    assert out == plain.render(messages=MESSAGES[:2])
    assert out.endswith("<|im_end|>200007   x a_b 1 {y")
