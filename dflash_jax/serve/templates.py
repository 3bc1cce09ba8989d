"""Chat templates from a checkpoint, rendered as data, never as code.

A HuggingFace chat template is a Jinja2 program written by whoever published the checkpoint. Rendered in a plain
`jinja2.Environment` it can reach Python's internals (`cycler.__init__.__globals__.os.popen(...)`), so a downloaded
checkpoint would run its author's code in the server. Here a template:

- renders only in jinja2's `ImmutableSandboxedEnvironment` (no attribute or item starting with `_`, no mutation of
  lists and dicts, no unsafe callables), with the extensions and helpers HF templates use: `loopcontrols`
  (`break` / `continue`), `trim_blocks` / `lstrip_blocks`, the `raise_exception(msg)` and `strftime_now(fmt)`
  globals and a `tojson` filter that keeps non-ASCII text;
- is checked when it is loaded (`ChatTemplate(source)`): its syntax, then every attribute and item name it
  spells, so a template that names a private attribute (`__globals__`, `_module`) anywhere, even in a branch no
  request reaches, is refused at start (`TemplateRefused`), never executed; then one trial render;
- fails one request at a time: whatever a template raises on some messages (its own `raise_exception`, a type
  error, the sandbox refusing an operation) becomes `TemplateRenderError` with the template's message, which the
  server returns as a 400 naming `messages`.
"""

from __future__ import annotations

import datetime
import json

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox


class TemplateRefused(ValueError):
    """The template is not valid Jinja, or reaches for Python internals: it is never rendered."""


class TemplateRenderError(ValueError):
    """The template failed on these messages (its own `raise_exception`, or an error while rendering)."""


class _RaisedByTemplate(Exception):
    pass


def _raise_exception(message):
    raise _RaisedByTemplate(str(message))


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(str(fmt))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def sandbox() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The one environment every template of the library renders in."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols],
                                                       undefined=jinja2.Undefined, autoescape=False)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _private_names(tree: jinja2.nodes.Node) -> list[str]:
    """Attribute and constant item names starting with `_` that the template spells."""
    found = []
    for node in tree.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem, jinja2.nodes.Filter)):
        if isinstance(node, jinja2.nodes.Getattr):
            name = node.attr
        elif isinstance(node, jinja2.nodes.Filter):  # `x|attr('__class__')`
            first = node.args[0] if node.name == "attr" and node.args else None
            if not (isinstance(first, jinja2.nodes.Const) and isinstance(first.value, str)):
                continue
            name = first.value
        elif isinstance(node.arg, jinja2.nodes.Const) and isinstance(node.arg.value, str):
            name = node.arg.value
        else:
            continue
        if name.startswith("_"):
            found.append(name)
    return found


TRIAL_MESSAGES = ({"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "Hello"},
                  {"role": "assistant", "content": "Hi."},
                  {"role": "user", "content": "def fib(n):"})


class ChatTemplate:
    """A checked, sandboxed chat template. `source` names where it came from in error messages."""

    def __init__(self, text: str, source: str = "the chat template"):
        if not isinstance(text, str) or not text.strip():
            raise TemplateRefused(f"{source} is empty or not a string")
        self.source = source
        env = sandbox()
        try:
            tree = env.parse(text)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateRefused(f"{source} is not a valid Jinja template (line {e.lineno}: {e.message})") from None
        private = _private_names(tree)
        if private:
            raise TemplateRefused(f"{source} reaches for Python internals ({', '.join(sorted(set(private)))}): it was "
                                  "not run; a chat template only formats messages. Remove the template (the server "
                                  "then uses a plain 'role: content' prompt) or use the model publisher's original")
        try:
            self.template = env.from_string(text)
        except jinja2.TemplateError as e:
            raise TemplateRefused(f"{source} does not compile: {e}") from None
        try:  # a template that cannot format a plain conversation is refused at start, not on every request
            self.render(list(TRIAL_MESSAGES))
        except TemplateRenderError as e:
            if isinstance(e.__cause__, jinja2.sandbox.SecurityError):
                raise TemplateRefused(f"{source} was stopped by the sandbox on a trial conversation ({e}): it was "
                                      "not run; remove it or use the model publisher's original") from None
            raise TemplateRefused(f"{source} fails on a plain conversation: {e}") from None

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        try:
            out = self.template.render(messages=messages, add_generation_prompt=add_generation_prompt)
        except _RaisedByTemplate as e:
            raise TemplateRenderError(f"the chat template refused these messages: {e}") from None
        except jinja2.sandbox.SecurityError as e:
            raise TemplateRenderError(f"the sandbox stopped the chat template: {e}") from e
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError,
                RecursionError, OverflowError) as e:
            raise TemplateRenderError(f"the chat template failed on these messages: "
                                      f"{type(e).__name__}: {e}") from e
        if not isinstance(out, str):
            raise TemplateRenderError("the chat template did not produce text")
        return out
