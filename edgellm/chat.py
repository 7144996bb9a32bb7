"""Render a model's chat template (tokenizer.chat_template, Jinja) into a prompt string.

A template comes from the model file, which is data: it is rendered in jinja2's immutable
sandbox, and here any attempt to reach an unsafe attribute (dunders, internals) fails at once
instead of quietly rendering as empty. Oversized repetition ('x' * 10**9) is refused too.

The rendering environment matches what transformers gives templates, so prompts agree with it:
trim_blocks and lstrip_blocks, the loop-control extension, `raise_exception`, `strftime_now`, a
`tojson` that does not escape HTML, `{% generation %}` blocks, and the variables `messages`,
`add_generation_prompt`, `tools`, `documents` and the special tokens' text (`bos_token`, ...).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .chat_builtin import BUILTIN_TEMPLATES  # noqa: F401 - re-exported
from .errors import MetadataError

MAX_REPEAT_LEN = 10_000_000  # the longest string or list a template may build with '*'

class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but reaching an unsafe attribute raises instead of giving Undefined,
    and '*' / '**' cannot build enormous values."""

    intercepted_binops = frozenset(["*", "**"])

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed "
                            "in a chat template")

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    if len(seq) * count > MAX_REPEAT_LEN:
                        raise SecurityError(f"a chat template tried to repeat a value {count} times")
            return left * right
        if operator == "**":
            if isinstance(right, int) and isinstance(left, int) and abs(right) > 4096:
                raise SecurityError(f"a chat template tried to compute {left} ** {right}")
            return left**right
        return super().call_binop(context, operator, left, right)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    a prompt only needs its content."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> _StrictSandbox:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


def render_chat_template(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                         source: str = "", tools: list | None = None, documents: list | None = None,
                         **variables) -> str:
    """The conversation `messages` ([{'role': ..., 'content': ...}, ...]) rendered with a Jinja chat
    template. variables: bos_token, eos_token and any other names the template reads. Raises
    MetadataError (naming the file and the Jinja error) when the template does not compile or render."""
    where = f"{source}: " if source else ""
    what = "the chat template (tokenizer.chat_template)"
    if not isinstance(messages, (list, tuple)) or not all(isinstance(msg, dict) for msg in messages):
        raise TypeError("messages must be a list of dicts such as {'role': 'user', 'content': '...'}")
    try:
        compiled = _compile(template)
    except TemplateError as e:
        line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise MetadataError(f"{where}{what} is not valid Jinja{line}: {e}") from None
    try:
        return compiled.render(messages=[dict(msg) for msg in messages], add_generation_prompt=add_generation_prompt,
                               tools=tools, documents=documents, **variables)
    except SecurityError as e:
        raise MetadataError(f"{where}{what} was stopped by the sandbox: {e}") from None
    except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError,
            OverflowError, RecursionError) as e:
        raise MetadataError(f"{where}{what} failed to render: {type(e).__name__}: {e}") from None
