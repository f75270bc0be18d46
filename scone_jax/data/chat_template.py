"""A checkpoint's chat template (jinja2), read from its files and rendered in a sandbox: how a conversation
becomes the text a chat model reads (data/conversations.py tokenizes it and finds the assistant's tokens).

Where the template comes from (data.chat_template, a tool's --chat_template):
  ''              beside data.tokenizer_path: chat_template.jinja, else tokenizer_config.json's `chat_template`
  a directory     the same two files inside it (a Hugging Face checkpoint directory)
  a .json file    a tokenizer_config.json: its `chat_template` (a string, or a list of {name, template} whose
                  'default' entry is used)
  any other file  the template's own text
Rendering follows Hugging Face's apply_chat_template: jinja2's immutable sandbox (a template cannot reach
Python objects or change its inputs), trim_blocks and lstrip_blocks, the loop controls, the `tojson` filter,
`raise_exception(message)` (a template's way of refusing a conversation), `strftime_now(format)`, the
`{% generation %}` block (rendered as plain text: the assistant's tokens are found from prefixes instead), and
the variables messages, add_generation_prompt, tools (none), documents (none), and bos_token, eos_token and
pad_token as the run's tokenizer spells them (its data.*_token policy). Nothing is fetched: a template that
includes or imports another file fails to load.

The sandbox bounds what a template may touch; a budget bounds how long one rendering runs (a nested
range(100000) loop would run for hours): at most MAX_STEPS steps (a loop iteration, a call) and MAX_SECONDS
seconds, and no repetition (`'x' * n`) or power larger than MAX_ITEMS items or MAX_POWER_BITS bits. Past any of
them the rendering stops with a TemplateError naming the template. Real templates take a few hundred steps per
conversation; the step budget is what normally stops a stuck one, the same on every machine.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import threading
import time

import jinja2
from jinja2 import ext, nodes, sandbox

from scone_jax.runtime import storage

JINJA_FILE, CONFIG_FILE = "chat_template.jinja", "tokenizer_config.json"


class TemplateError(ValueError):
    """A template that cannot be read, does not compile, or fails on a conversation."""


class _Generation(ext.Extension):
    """`{% generation %}...{% endgeneration %}`: Hugging Face's marker of the assistant's text, rendered as its
    body (data/conversations.py finds the assistant's tokens without it)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message):
    raise TemplateError(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string):
    return datetime.datetime.now().strftime(format_string)


MAX_STEPS = 1_000_000  # loop iterations and calls in one rendering
MAX_SECONDS = 30.0  # one rendering's wall-clock time, checked at each step
MAX_ITEMS = 10_000_000  # characters (or items) a repetition may make
MAX_POWER_BITS = 100_000  # bits a power's result may have
_STEPS_FILTER = "__scone_counted"  # the filter every {% for %}'s iterable passes through


class _Budget(threading.local):
    """The steps and the deadline left to the rendering running in this thread (None: no rendering)."""

    steps: int = 0
    deadline: float | None = None
    origin: str = ""


_budget = _Budget()


def _step() -> None:
    _budget.steps -= 1
    if _budget.steps < 0:
        raise TemplateError(f"the chat template of {_budget.origin} took more than {MAX_STEPS:,} steps (loop "
                            "iterations and calls) to render one conversation: a runaway loop")
    if _budget.deadline is not None and not _budget.steps & 1023 and time.monotonic() > _budget.deadline:
        raise TemplateError(f"the chat template of {_budget.origin} took more than {MAX_SECONDS:g} s to render one "
                            "conversation")


def _counted(iterable):
    for item in iterable:
        _step()
        yield item


class _BoundedEnvironment(sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox with every call, loop iteration, repetition and power counted against the budget."""

    intercepted_binops = frozenset({"*", "**"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        _step()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator, left, right):
        _step()
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and isinstance(count, int) and \
                        len(sequence) * count > MAX_ITEMS:
                    raise TemplateError(f"the chat template of {_budget.origin} repeats a sequence into more than "
                                        f"{MAX_ITEMS:,} items")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                abs(right) * max(abs(left).bit_length(), 1) > MAX_POWER_BITS:
            raise TemplateError(f"the chat template of {_budget.origin} computes a power of more than "
                                f"{MAX_POWER_BITS:,} bits")
        return super().call_binop(context, operator, left, right)


def _environment() -> _BoundedEnvironment:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols, _Generation],
                              loader=None, undefined=jinja2.Undefined)
    env.filters["tojson"] = _tojson
    env.filters[_STEPS_FILTER] = _counted
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


def _compile(env: _BoundedEnvironment, source: str):
    """`source` compiled with every {% for %} iterating through the step counter."""
    tree = env.parse(source)
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Filter(loop.iter, _STEPS_FILTER, [], [], None, None, lineno=loop.lineno)
    return env.from_string(tree)


class ChatTemplate:
    """A compiled chat template and where it came from; pickles as its source (grain and tokenizing workers)."""

    def __init__(self, source: str, origin: str):
        self.source, self.origin = source, origin
        try:
            self._template = _compile(_environment(), source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"The chat template of {origin} does not compile: {e.message} (template line "
                                f"{e.lineno}). Fix: repair it, or set data.chat_template to another one.") from None

    def __getstate__(self):
        return {"source": self.source, "origin": self.origin}

    def __setstate__(self, state):
        self.__init__(state["source"], state["origin"])

    @property
    def fingerprint(self) -> str:
        """The first 16 hex digits of the sha256 of the template's text: what pre-tokenized chat shards record."""
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()[:16]

    def render(self, messages: list[dict], add_generation_prompt: bool, special: dict[str, str]) -> str:
        """The text of `messages`; `special` gives bos_token, eos_token and pad_token. TemplateError (the
        template's own words where it raised them) for a conversation it cannot render or that runs past the
        budget (module docstring)."""
        _budget.steps, _budget.deadline, _budget.origin = MAX_STEPS, time.monotonic() + MAX_SECONDS, self.origin
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, **special)
        except TemplateError:
            raise
        except RecursionError:  # a macro or a recursive loop that calls itself without end
            raise TemplateError(f"the chat template of {self.origin} recurses without end rendering it") from None
        except jinja2.TemplateError as e:  # undefined attributes, sandbox refusals, includes, ...
            raise TemplateError(f"the chat template of {self.origin} does not render it ({type(e).__name__}: "
                                f"{e})") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise TemplateError(f"the chat template of {self.origin} does not render it ({type(e).__name__}: "
                                f"{e})") from None


def special_spellings(tokenizer) -> dict[str, str]:
    """bos_token, eos_token and pad_token as `tokenizer` spells its ids (the run's data.*_token policy)."""
    ids = tokenizer.special_ids
    return {f"{role}_token": tokenizer.id_to_token(ids[role]) for role in ("bos", "eos", "pad")}


def _read(path: str) -> str | None:
    if storage.is_remote(path):
        data = storage.read_file(path)
    elif os.path.isfile(path):
        with open(path, "rb") as f:
            data = f.read()
    else:
        return None
    if data is None:
        return None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise TemplateError(f"{path} is not UTF-8 text. Fix: point data.chat_template at a template file or a "
                            "tokenizer_config.json.") from None


def _from_config(path: str, text: str) -> str:
    try:
        config = json.loads(text)
    except ValueError as e:
        raise TemplateError(f"{path} is not valid JSON ({e}). Fix: point data.chat_template at a "
                            f"tokenizer_config.json or a template file.") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if not isinstance(template, str) or not template.strip():
        raise TemplateError(f"{path} has no chat_template (a base checkpoint may ship none). Fix: set "
                            "data.chat_template to a template file (.jinja) written for this tokenizer.")
    return template


def _in_directory(directory: str) -> tuple[str, str] | None:
    """(template text, its path) from chat_template.jinja or tokenizer_config.json in `directory`, None if neither."""
    jinja_path = f"{directory.rstrip('/')}/{JINJA_FILE}"
    text = _read(jinja_path)
    if text is not None:
        return text, jinja_path
    config_path = f"{directory.rstrip('/')}/{CONFIG_FILE}"
    text = _read(config_path)
    return (_from_config(config_path, text), config_path) if text is not None else None


def load(chat_template: str, tokenizer_path: str) -> ChatTemplate:
    """The template `chat_template` names (module docstring), '' = the one beside `tokenizer_path`."""
    if not chat_template:
        if not tokenizer_path:
            raise TemplateError("data.source='chat' needs a chat template, and data.tokenizer_path is '' (no "
                                "checkpoint files to read one from). Fix: set data.chat_template to a template file, "
                                "or data.tokenizer_path to a checkpoint's tokenizer.json beside its "
                                "tokenizer_config.json.")
        directory = os.path.dirname(tokenizer_path) or "."
        found = _in_directory(directory)
        if found is None:
            raise TemplateError(f"No {JINJA_FILE} or {CONFIG_FILE} beside data.tokenizer_path={tokenizer_path!r}, so "
                                "there is no chat template. Fix: set data.chat_template to a template file or a "
                                "tokenizer_config.json.")
        return ChatTemplate(*found)
    if not storage.is_remote(chat_template) and os.path.isdir(chat_template):
        found = _in_directory(chat_template)
        if found is None:
            raise TemplateError(f"data.chat_template={chat_template!r} is a directory without {JINJA_FILE} or "
                                f"{CONFIG_FILE}. Fix: name the template file itself.")
        return ChatTemplate(*found)
    text = _read(chat_template)
    if text is None:
        raise TemplateError(f"data.chat_template={chat_template!r} does not exist. Fix: name a template file (.jinja), "
                            "a tokenizer_config.json or a checkpoint directory.")
    if chat_template.endswith(".json"):
        return ChatTemplate(_from_config(chat_template, text), chat_template)
    return ChatTemplate(text, chat_template)
