"""Chat templates rendered as transformers' `apply_chat_template(tokenize=False)` renders them: its
sandboxed jinja2 environment, globals and filters, the tokenizer's special tokens as variables, and its
handling of continue_final_message. The template is `--chat-template` (a file, the template itself, or
the name of one of the model's templates, as vLLM reads it) or else the model's own (chat_template.jinja,
additional_chat_templates/, tokenizer_config.json, as transformers loads them)."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
DEFAULT_TEMPLATE = "default"  # the name transformers picks among several templates
MIN_JINJA2 = (3, 1, 6)  # transformers refuses older jinja2: its sandbox had known escapes
# Variables the renderer sets itself; chat_template_kwargs may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents"})
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of where the final message ends
_JINJA_CHARS = "{}\n"  # a --chat-template value with none of these is taken for a file path


class ChatTemplateError(ValueError):
    """The chat cannot be rendered: no template, one that does not compile, or one that failed on these
    messages (its raise_exception included). The message says which, for the client; param names the
    request field at fault, if one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatTemplate:
    """What a server renders chats with. source None: there is no template, `missing` says why.
    special_tokens: the tokenizer's, as transformers' special_tokens_map hands them to the template."""

    source: str | None
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    missing: str = "this model has no chat template: start the server with --chat-template FILE|STRING"

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
               continue_final_message: bool = False, variables: Mapping[str, Any] | None = None,
               tools: list[dict[str, Any]] | None = None, documents: list[dict[str, str]] | None = None) -> str:
        """The prompt text of `messages` (dicts with role and content strings, keys with None values
        dropped as transformers does). variables: more template variables (chat_template_kwargs); they
        take precedence over the special tokens. tools: the request's tool definitions (OpenAI's form);
        documents: its documents for retrieval-augmented templates (transformers' variable)."""
        if self.source is None:
            raise ChatTemplateError(self.missing)
        variables = dict(variables or {})
        reserved = sorted(RESERVED_VARIABLES & variables.keys())
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs: {', '.join(map(repr, reserved))} cannot be set there "
                                    f"(the request sets it)", "chat_template_kwargs")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message: cannot be true with add_generation_prompt (set that "
                                    "false to continue the final message)", "continue_final_message")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        final = None
        if continue_final_message:
            final = chat[-1].get("content") if chat else None
            if final is None:
                raise ChatTemplateError("continue_final_message: the final message has no content to continue",
                                        "continue_final_message")
            if "content" not in self.source:
                raise ChatTemplateError("continue_final_message: the chat template does not read 'content'",
                                        "continue_final_message")
            chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
        template = _compile(self.source)
        try:
            text = template.render(messages=chat, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt,
                                   **{**self.special_tokens, **variables})
        except Exception as e:  # the template is code from the model or the operator: any failure is its own
            raise ChatTemplateError(f"chat template: {_describe(e)}") from None
        return text if final is None else _cut_at_final_message(text, final)


def load_chat_template(model: str, chat_template: str | None = None) -> ChatTemplate:
    """The template for a model directory: `chat_template` (--chat-template: the name of one of the
    model's templates, a file, or the template itself) if given, else the model's own. A directory
    without tokenizer files (or `model` not a directory) has no special tokens. ValueError: a
    --chat-template that looks like a path but cannot be read, or that does not compile."""
    config = tokenizer_config(model)
    tokens = special_tokens(config)
    templates = model_chat_templates(model, config)
    if chat_template is not None:
        source = templates[chat_template] if chat_template in templates else read_template_arg(chat_template)
        try:
            _compile(source)
        except ChatTemplateError as e:
            raise ValueError(f"--chat-template: {e}") from None
        return ChatTemplate(source, tokens)
    if not templates:
        return ChatTemplate(None, tokens)
    if len(templates) == 1:
        return ChatTemplate(next(iter(templates.values())), tokens)
    if DEFAULT_TEMPLATE in templates:
        return ChatTemplate(templates[DEFAULT_TEMPLATE], tokens)
    return ChatTemplate(None, tokens, f"this model has several chat templates and none named {DEFAULT_TEMPLATE!r} "
                                      f"({', '.join(sorted(templates))}): start the server with --chat-template NAME")


def model_chat_templates(model: str, config: Mapping[str, Any]) -> dict[str, str]:
    """A model's templates by name, as transformers loads them: chat_template.jinja ("default") and
    additional_chat_templates/NAME.jinja take precedence over tokenizer_config.json's chat_template (one
    string, or a list of {name, template})."""
    found: dict[str, str] = {}
    default = os.path.join(model, CHAT_TEMPLATE_FILE)
    if os.path.isfile(default):
        found[DEFAULT_TEMPLATE] = _read_text(default)
    extra = os.path.join(model, CHAT_TEMPLATE_DIR)
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                found[name.removesuffix(".jinja")] = _read_text(os.path.join(extra, name))
    if found:
        return found
    value = config.get("chat_template")
    if isinstance(value, str):
        return {DEFAULT_TEMPLATE: value}
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value if isinstance(t, dict) and "name" in t and "template" in t}
    return {}


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """transformers' special_tokens_map from a tokenizer_config.json: every `*_token` entry that is a
    token (a string, or an AddedToken's {"content": ...}), and extra_special_tokens given by name."""
    named = {k: v for k, v in config.items() if k.endswith("_token")}
    for key in ("extra_special_tokens", "model_specific_special_tokens"):
        if isinstance(config.get(key), dict):
            named.update(config[key])
    out = {}
    for name, value in named.items():
        if isinstance(value, dict) and value.get("__type") == "AddedToken":
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def read_template_arg(value: str) -> str:
    """--chat-template as vLLM reads it: the file's text, else (when the value has a '{', '}' or a
    newline, as a template would) the value itself."""
    try:
        return _read_text(value)
    except OSError as e:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"--chat-template {value!r}: looks like a file path, but it cannot be read "
                             f"({e.strerror or e})") from None
        return value


# ---------------------------------------------------------------------------- transformers' environment
@functools.lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    env = _environment()
    try:
        return env.from_string(source)
    except Exception as e:
        raise ChatTemplateError(f"chat template does not compile: {_describe(e)}") from None


@functools.cache
def _environment() -> Any:
    """transformers' (chat_template_utils._cached_compile_jinja_template): ImmutableSandboxedEnvironment
    with trim_blocks and lstrip_blocks, loop controls, {% generation %} blocks, raise_exception,
    strftime_now, its tojson, and dict() and namespace() that cannot reach Python's internals."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < MIN_JINJA2:
        raise ImportError(f"chat templates need jinja2>={'.'.join(map(str, MIN_JINJA2))} (older ones have sandbox "
                          f"escapes), found {jinja2.__version__}")

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: marks assistant text for transformers' training
        masks; rendered as its body."""

        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature trick: namespace(self=...) works
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_', got {name!r}")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env


def _cut_at_final_message(text: str, final: str) -> str:
    """transformers' continue_final_message: the render up to where the final message's content ends
    (whatever the template writes after it, an end-of-turn token for one, is dropped)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message: the final message does not appear in the rendered chat "
                                "(the chat template drops part of it)", "continue_final_message")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def _describe(e: Exception) -> str:
    import jinja2

    if type(e) is jinja2.exceptions.TemplateError:  # raise_exception's: the template's own words
        return str(e)
    return f"{type(e).__name__}: {e}"


def tokenizer_config(directory: str) -> dict[str, Any]:
    """A tokenizer directory's tokenizer_config.json as a dict ({} where it is missing or not a JSON object)."""
    try:
        with open(os.path.join(directory, TOKENIZER_CONFIG_FILE), encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
