"""Chat templates: a Jinja sandbox with bounds on size and time, as transformers renders them.

Owns compiling and rendering chat templates, which are untrusted code (from the Hub, or
from a request under ``--trust-request-chat-template``). Jinja's sandbox stops attribute
escapes but not resource abuse: ``{{ 'a' * 10**8 }}`` builds 100 MB in one operation, and
nested loops over ``range`` run for hours. So string-growing operations are capped before
they run, the output is cut off at a size the caller gives, and a time budget stops a
render that loops (a line tracer, on the rendering thread only, and only when asked).
"""

from __future__ import annotations

import functools
import json
import string
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from types import FrameType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from tokenmill.errors import ContextLengthError, InvalidRequestError

MAX_VALUE_CHARS = 2**24
"""Largest string or list one template operation may build (16M characters)."""
MAX_POWER_BITS = 4096
"""Largest integer ``**`` may build in a template."""
_TRACE_CHECK_EVERY = 1000
"""Line events between clock reads in the time-budget tracer."""
_WIDTH_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})


class RenderBudgetExceeded(InvalidRequestError):
    """A chat template ran past its time budget."""


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"chat template error: {message}", param="messages")


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (assistant masks) as plain output."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _check_size(num_items: int, what: str) -> None:
    if num_items > MAX_VALUE_CHARS:
        raise SecurityError(
            f"{what} would build {num_items} items, more than the {MAX_VALUE_CHARS} a template may"
        )


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, refusing operations that would build huge values."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(times, int):
                    _check_size(len(seq) * times, "repeating a sequence")
        elif (
            operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1
        ):
            if right * abs(left).bit_length() > MAX_POWER_BITS:
                raise SecurityError(f"the power would have more than {MAX_POWER_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            _check_format_widths(left.replace("%%", ""), printf=True)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            if name in _WIDTH_METHODS and args and isinstance(args[0], int):
                width = len(owner) * args[0] if name == "expandtabs" else args[0]
                _check_size(width, f"str.{name}")
            elif (
                name == "replace"
                and len(args) >= 2
                and isinstance(args[0], str)
                and isinstance(args[1], str)
            ):
                count = owner.count(args[0]) if args[0] else len(owner) + 1
                _check_size(len(owner) + count * len(args[1]), "str.replace")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        """``str.format`` and ``format_map``, which the sandbox wraps when they are looked up."""
        wrapper = super().wrap_str_format(value)
        if wrapper is not None:
            _check_format_widths(value.__self__, printf=False)
        return wrapper


def _check_format_widths(fmt: str, printf: bool) -> None:
    """Refuse a format string whose field widths or precisions would build a huge string."""
    if printf:
        numbers = [int(n) for n in _printf_numbers(fmt)]
    else:
        numbers = []
        for _, _, spec, _ in string.Formatter().parse(fmt):
            numbers += [int(n) for n in _digit_runs(spec or "")]
    for number in numbers:
        _check_size(number, "a format field width")


def _digit_runs(text: str) -> list[str]:
    runs, current = [], ""
    for char in text:
        if char.isdigit():
            current += char
        elif current:
            runs.append(current)
            current = ""
    return [*runs, current] if current else runs


def _printf_numbers(fmt: str) -> list[str]:
    """Widths and precisions of ``%`` conversions (the digits between ``%`` and the type)."""
    numbers: list[str] = []
    for part in fmt.split("%")[1:]:
        spec = ""
        for char in part:
            if char.isalpha():
                break
            spec += char
        numbers += _digit_runs(spec)
    return numbers


@functools.lru_cache(maxsize=1)
def _jinja_environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.filters["center"] = _bounded_center
    env.filters["indent"] = _bounded_indent
    env.filters["wordwrap"] = _bounded_wordwrap
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _bounded_center(value: str, width: int = 80) -> str:
    _check_size(width, "the center filter")
    return str(value).center(width)


def _bounded_indent(
    value: str, width: int | str = 4, first: bool = False, blank: bool = False
) -> str:
    pad_chars = len(width) if isinstance(width, str) else width
    _check_size(len(str(value)) + pad_chars * (str(value).count("\n") + 1), "the indent filter")
    return jinja2.filters.do_indent(value, width, first, blank)


def _bounded_wordwrap(
    environment: Any, value: str, width: int = 79, *args: Any, **kwargs: Any
) -> str:
    _check_size(width, "the wordwrap filter")
    return jinja2.filters.do_wordwrap(environment, value, width, *args, **kwargs)


_bounded_wordwrap.jinja_pass_arg = jinja2.utils._PassArg.environment  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=64)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template once; a syntax error becomes an InvalidRequestError."""
    try:
        return _jinja_environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(
            f"chat template is invalid: {type(exc).__name__}: {exc}", param="chat_template"
        ) from exc


def render_bounded(
    template: jinja2.Template,
    context: dict[str, Any],
    max_chars: int | None,
    time_budget_s: float | None,
) -> str:
    """Render ``template``; past ``max_chars`` of output it is a context-length error, past
    ``time_budget_s`` an InvalidRequestError (the budget is only checked when given)."""
    parts: list[str] = []
    num_chars = 0
    with _time_budget(time_budget_s):
        for piece in template.generate(**context):
            num_chars += len(piece)
            if max_chars is not None and num_chars > max_chars:
                raise ContextLengthError(
                    f"the chat template rendered more than {max_chars} characters, more than this "
                    "model's context can hold",
                    param="messages",
                )
            parts.append(piece)
    return "".join(parts)


@contextmanager
def _time_budget(budget_s: float | None) -> Iterator[None]:
    """Raise RenderBudgetExceeded in this thread once ``budget_s`` has passed (None: no budget)."""
    if budget_s is None:
        yield
        return
    deadline = time.monotonic() + budget_s
    num_events = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal num_events
        num_events += 1
        if num_events % _TRACE_CHECK_EVERY == 0 and time.monotonic() > deadline:
            raise RenderBudgetExceeded(
                f"the chat template took longer than {budget_s:g}s to render", param="chat_template"
            )
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)
