"""Tokenizers: HF `tokenizers` for a checkpoint's tokenizer.json or a GGUF's metadata, bytes for the tiny model.

Both expose the same small interface (`encode`, `decode`, `apply_chat_template`, special
ids). Chat templates are the checkpoint's own Jinja template, found where transformers finds
it (chat_template.jinja, else tokenizer_config.json's "chat_template"; a GGUF's
tokenizer.chat_template), or `server.chat_template` in its place, and rendered in a sandbox
as transformers does, with `tools=` and any template kwargs (a checkpoint's named "tool_use"
template when tools are given, as transformers picks it); the byte tokenizer of the tiny
model has a built-in one that renders tools, tool calls and tool results. A checkpoint with no
template gets no stand-in: chat requests are refused (`NoChatTemplateError`), completions work. A GGUF's byte-level BPE is rebuilt from its vocabulary, merges and
token types, split before BPE the way llama.cpp splits for its `tokenizer.ggml.pre`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from datetime import datetime
from typing import Any, Callable, Optional, Protocol

import jinja2

from jaxcb.config import ConfigError
from jaxcb.errors import InvalidRequestError
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"  # what decoding shows for bytes that are not (yet) a whole UTF-8 character
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where current transformers saves a checkpoint's template
ADDITIONAL_CHAT_TEMPLATES_DIR = "additional_chat_templates"  # and its other named templates, NAME.jinja
PROCESSOR_CHAT_TEMPLATE_FILE = "chat_template.json"  # a multimodal processor's {"chat_template": ...}
SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")  # no tokenizer.json beside
# The tiny model's template: one "<|role|>" line per turn; tools listed in a system turn; assistant
# tool calls and tool results in the hermes form (<tool_call>{"name": ..., "arguments": ...}</tool_call>).
TINY_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nTools; call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>\n"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ '\\n' }}"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for call in m.get('tool_calls') or [] %}<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}</tool_call>{% endfor %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}"
)


class NoChatTemplateError(InvalidRequestError):
    """A chat request for a model whose checkpoint has no chat template (and no server.chat_template)."""


class ChatTemplateError(InvalidRequestError):
    """The template refused the conversation (its raise_exception), or failed to render it."""


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: Optional[int]
    eos_token_ids: list[int]
    chat_template: Optional[str]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def decode_stream(self, skip_special_tokens: bool = True) -> Optional[Callable[[int], Optional[str]]]:
        """A function fed a sequence's ids one by one that returns the text each adds, once it ends in
        a whole character (None while it does not, or when the id adds no text): together what
        `decode` gives for all of them, but for a held-back tail. None: the tokenizer has none."""
        ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: Optional[list[dict[str, Any]]] = None, **template_kwargs: Any,
    ) -> str: ...


def tools_chat_template(tokenizer: Tokenizer) -> Optional[str]:
    """The template a chat with tools renders with (its named "tool_use" one where the checkpoint has one):
    the one whose text says how the model writes its tool calls."""
    return getattr(tokenizer, "tool_use_template", None) or tokenizer.chat_template


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str) -> jinja2.Template:
    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat_template(
    template: Optional[str], messages: list[dict[str, Any]], add_generation_prompt: bool,
    tools: Optional[list[dict[str, Any]]] = None, **extra: Any,
) -> str:
    """The template rendered as transformers' apply_chat_template renders it (same sandbox, globals
    and arguments); NoChatTemplateError without a template, ChatTemplateError when it fails."""
    if template is None:
        raise NoChatTemplateError(
            "this model's checkpoint has no chat template, so chat messages cannot be turned into a prompt; "
            "send a prompt to /v1/completions (or a 'prompt' in a job record), or start jaxcb with "
            "server.chat_template=FILE_OR_TEMPLATE"
        )
    try:
        return _compiled_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template: {e}") from None
    except (TypeError, KeyError, AttributeError, ValueError) as e:  # a message the template cannot read
        raise ChatTemplateError(f"chat template could not render these messages: {type(e).__name__}: {e}") from None


def read_chat_template_override(value: str) -> str:
    """`server.chat_template`: a file's contents when it names one, else the template itself."""
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" not in value:
        raise ConfigError(
            f"server.chat_template={value} is neither a file nor a Jinja template; give the path of a "
            f".jinja file or the template's text"
        )
    return value


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then <bos>=256, <eos>=257, <pad>=258."""

    BOS, EOS, PAD = 256, 257, 258

    def __init__(self) -> None:
        self.vocab_size = 259
        self.bos_token_id: Optional[int] = self.BOS
        self.eos_token_ids = [self.EOS]
        self.chat_template: Optional[str] = TINY_CHAT_TEMPLATE

    @property
    def token_bytes(self) -> list[bytes]:
        """Each id's bytes (the specials' names), for grammar engines."""
        return [bytes([i]) for i in range(256)] + [b"<bos>", b"<eos>", b"<pad>"]

    special_token_ids = (BOS, EOS, PAD)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS] + ids if add_special_tokens else ids

    SPECIAL_NAMES = {BOS: "<bos>", EOS: "<eos>", PAD: "<pad>"}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The bytes' text; with skip_special_tokens=False the special ids as their names, as HF tokenizers keep them."""
        stream = Utf8Stream(None if skip_special_tokens else self.SPECIAL_NAMES)
        return "".join(t for t in map(stream.step, ids) if t) + stream.rest()

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], Optional[str]]:
        return Utf8Stream(None if skip_special_tokens else self.SPECIAL_NAMES).step

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: Optional[list[dict[str, Any]]] = None, **template_kwargs: Any,
    ) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt, tools, **template_kwargs)


class Utf8Stream:
    """ByteTokenizer's decode stream: the bytes since the last whole character, decoded as `decode`
    decodes them. Ids past the bytes add nothing, or (`names`) their name after the pending bytes."""

    def __init__(self, names: Optional[dict[int, str]] = None) -> None:
        self._pending = bytearray()
        self._names = names or {}

    def rest(self) -> str:
        """The bytes still pending (an unfinished character), as `decode` shows them at the end."""
        text, self._pending = self._pending.decode("utf-8", errors="replace"), bytearray()
        return text

    def step(self, token_id: int) -> Optional[str]:
        if not 0 <= token_id < 256:
            name = self._names.get(token_id)
            return self.rest() + name if name is not None else None
        self._pending.append(token_id)
        text = self._pending.decode("utf-8", errors="replace")
        if text.endswith(REPLACEMENT):
            return None
        self._pending.clear()
        return text


def _token_text(value: Any) -> Optional[str]:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config.json files
        return value.get("content")
    return value


def read_chat_templates(directory: str, config: dict[str, Any]) -> dict[str, str]:
    """The directory's chat templates by name ("default" the one a chat renders with; "tool_use", where a
    checkpoint has it, the one transformers renders with when tools are given), where transformers
    looks: chat_template.jinja and additional_chat_templates/NAME.jinja (current transformers), else
    tokenizer_config.json's "chat_template", one template or a list of named ones (older checkpoints),
    else a processor's chat_template.json. A template that is not a string is refused by name."""
    path = os.path.join(directory, CHAT_TEMPLATE_FILE)
    if os.path.isfile(path):
        templates = {"default": _read_text(path)}
        extra_dir = os.path.join(directory, ADDITIONAL_CHAT_TEMPLATES_DIR)
        for name in sorted(os.listdir(extra_dir)) if os.path.isdir(extra_dir) else ():
            if name.endswith(".jinja"):
                templates[name[: -len(".jinja")]] = _read_text(os.path.join(extra_dir, name))
        return templates
    source, template = "tokenizer_config.json", config.get("chat_template")
    if template is None and os.path.isfile(os.path.join(directory, PROCESSOR_CHAT_TEMPLATE_FILE)):
        source = PROCESSOR_CHAT_TEMPLATE_FILE
        template = _read_json(os.path.join(directory, source)).get("chat_template")
    if template is None or isinstance(template, str):
        return {} if template is None else {"default": template}
    named = template if isinstance(template, list) else []
    if not named or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                            and isinstance(t.get("template"), str) for t in named):
        raise ConfigError(f"{os.path.join(directory, source)}: chat_template must be a Jinja template or a list of "
                          f'{{"name": ..., "template": ...}}; got {json.dumps(template)[:80]}; fix it, or set '
                          f"server.chat_template=FILE_OR_TEMPLATE")
    return {t["name"]: t["template"] for t in named}


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); fix or replace it") from None


class HFTokenizer:
    """A `tokenizers.Tokenizer` with tokenizer_config.json's specials and chat template.

    From a checkpoint directory (tokenizer.json + tokenizer_config.json + chat_template.jinja)
    or from a GGUF file's metadata; `save` writes the directory form."""

    def __init__(self, tok: Any, config: dict[str, Any], chat_template: Optional[str], source: str,
                 extra_eos_token_ids: tuple[int, ...] = (), tool_use_template: Optional[str] = None):
        self._tok = tok
        self._config = config
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids = sorted(({eos_id} if eos_id is not None else set()) | set(extra_eos_token_ids))
        self.chat_template = chat_template
        # The template transformers renders with when tools are given (a checkpoint's named "tool_use"
        # one); dropped when chat_template is replaced (server.chat_template).
        self._tool_use_template = tool_use_template
        if chat_template is None and tool_use_template is None:  # (only "tool_use": warned by from_directory)
            log.warning(
                "%s has no chat template: chat requests will be refused (completions work) unless "
                "server.chat_template=FILE_OR_TEMPLATE is set", source,
            )
        # tokenizer.json's post-processor decides BOS; add it ourselves only where the config asks and it is absent.
        self._add_bos = bool(config.get("add_bos_token", False))

    @property
    def chat_template(self) -> Optional[str]:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: Optional[str]) -> None:
        self._chat_template = template
        self._tool_use_template = None

    @property
    def tool_use_template(self) -> Optional[str]:
        """The checkpoint's named "tool_use" template, which renders a chat that gives tools; None: the default."""
        return self._tool_use_template

    @property
    def backend_tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer` (its JSON form is what grammar engines read)."""
        return self._tok

    @classmethod
    def from_directory(cls, directory: str) -> "HFTokenizer":
        from tokenizers import Tokenizer as _Tokenizer

        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            slow = [name for name in SLOW_TOKENIZER_FILES if os.path.isfile(os.path.join(directory, name))]
            only = (f" (only {', '.join(slow)}, a slow tokenizer, which jaxcb does not read: transformers' "
                    f"AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) writes tokenizer.json)") if slow else ""
            raise ConfigError(
                f"{directory} has no tokenizer.json{only}, so its token ids cannot be read or written; set "
                f"model.tokenizer=DIR to a directory that has the model's tokenizer.json"
            )
        config_path = os.path.join(directory, "tokenizer_config.json")
        config: dict[str, Any] = _read_json(config_path) if os.path.isfile(config_path) else {}
        try:
            tok = _Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ConfigError(f"{path} cannot be read by the tokenizers library ({e}); replace it with the "
                              f"model's tokenizer.json") from None
        templates = read_chat_templates(directory, config)
        if templates and "default" not in templates:
            log.warning("%s names chat templates %s but none 'default': a chat without tools has no template "
                        "and is refused, as transformers refuses it (or set server.chat_template=FILE_OR_TEMPLATE)",
                        directory, ", ".join(sorted(templates)))
        return cls(tok, config, templates.get("default"), directory, tool_use_template=templates.get("tool_use"))

    @classmethod
    def from_gguf(cls, path: str) -> "HFTokenizer":
        tok, config, end_ids = gguf_tokenizer(path)
        return cls(tok, config, config.get("chat_template"), path, tuple(end_ids))

    def save(self, directory: str) -> None:
        """Write tokenizer.json, and tokenizer_config.json with the chat template in it."""
        self._tok.save(os.path.join(directory, "tokenizer.json"))
        config = {k: v for k, v in self._config.items() if v is not None}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> Optional[Callable[[int], Optional[str]]]:
        """`tokenizers`' DecodeStream (0.21 on): one call into Rust a token."""
        from tokenizers import decoders

        if not hasattr(decoders, "DecodeStream"):
            return None
        return functools.partial(decoders.DecodeStream(skip_special_tokens=skip_special_tokens).step, self._tok)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: Optional[list[dict[str, Any]]] = None, **template_kwargs: Any,
    ) -> str:
        specials = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        # transformers' choice: "tool_use" whenever tools are passed (an empty list too), else the default
        template = self._tool_use_template if tools is not None and self._tool_use_template is not None \
            else self.chat_template
        return render_chat_template(
            template, messages, add_generation_prompt, tools, **{**specials, **template_kwargs}
        )


def load_tokenizer(path: Optional[str]) -> Tokenizer:
    """The tokenizer of a checkpoint directory (tokenizer.json) or GGUF file; the byte-level one
    for a model without a checkpoint (random weights). A directory without tokenizer.json is
    refused: its model would read bytes as token ids."""
    if path is None:
        return ByteTokenizer()
    if path.endswith(".gguf") and os.path.isfile(path):
        return HFTokenizer.from_gguf(path)
    return HFTokenizer.from_directory(path)


def chat_prompt_ids(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
    tools: Optional[list[dict[str, Any]]] = None, *, continue_final_message: bool = False, **template_kwargs: Any,
) -> list[int]:
    """Token ids of a chat rendered with the tokenizer's template, by default ready for the
    assistant's turn; raises InvalidRequestError (NoChatTemplateError, ChatTemplateError).
    `continue_final_message`: the prompt ends inside the last message (its end-of-turn cut
    off), so that the reply continues it -- as transformers does.

    Chat templates write BOS themselves (where the model wants one), so their text is encoded
    without adding it again -- as transformers' apply_chat_template(tokenize=True) does. The
    byte tokenizer's BOS has no text form: it adds it to the encoded template."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt, tools, **template_kwargs)
    if continue_final_message:
        final = (messages[-1].get("content") or "").strip() if messages else ""
        end = text.rfind(final) if final else -1
        if end < 0:
            raise ChatTemplateError("continue_final_message: the chat template does not write the final message's "
                                    "content as given, so the reply cannot continue it")
        text = text[: end + len(final)]
    return tokenizer.encode(text, add_special_tokens=isinstance(tokenizer, ByteTokenizer))


# GGUF tokenizers. tokenizer.ggml.pre -> how text is split before BPE, as llama.cpp splits it for that name.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's but for digits, which it splits one by one (Qwen2's tokenizer.json and llama.cpp's "qwen2").
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZERS = {
    "gpt-2": ("gpt2",),
    "smollm": ("digits", "gpt2"),
    "llama-bpe": ("llama3",),
    "llama3": ("llama3",),
    "llama-v3": ("llama3",),
    "smaug-bpe": ("llama3",),
    "qwen2": ("qwen2",),  # Qwen2, Qwen2.5, Qwen3
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _pre_tokenizer(steps: tuple[str, ...]):
    from tokenizers import pre_tokenizers

    parts = {
        "digits": lambda: pre_tokenizers.Digits(individual_digits=True),
        "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        "llama3": lambda: _split_then_bytes(_LLAMA3_REGEX),
        "qwen2": lambda: _split_then_bytes(_QWEN2_REGEX),
    }
    built = [parts[s]() for s in steps]
    return built[0] if len(built) == 1 else pre_tokenizers.Sequence(built)


def _split_then_bytes(regex: str):
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def gguf_tokenizer_problems(path: str) -> list[str]:
    """Why the GGUF's own tokenizer cannot be built (empty when it can); read from metadata only."""
    from jaxcb.model.gguf import metadata, open_gguf

    reader = open_gguf(path)
    model, pre = metadata(reader, "tokenizer.ggml.model"), metadata(reader, "tokenizer.ggml.pre", "default")
    hint = "; or set model.tokenizer=DIR to the model's Hugging Face tokenizer directory"
    if model != "gpt2":
        return [f"tokenizer.ggml.model={model!r}: jaxcb builds byte-level BPE ('gpt2') tokenizers from a GGUF only{hint}"]
    if pre not in GGUF_PRE_TOKENIZERS:
        return [f"tokenizer.ggml.pre={pre!r} is not a pre-tokenizer jaxcb knows ({', '.join(GGUF_PRE_TOKENIZERS)}){hint}"]
    if metadata(reader, "tokenizer.ggml.merges") is None:
        return [f"the GGUF has no tokenizer.ggml.merges{hint}"]
    return []


def gguf_tokenizer(path: str) -> tuple[Any, dict[str, Any], list[int]]:
    """(tokenizers.Tokenizer, tokenizer_config.json-style dict, end-of-turn ids) from the GGUF's metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    from jaxcb.model.gguf import metadata, open_gguf
    from jaxcb.model.loader import CheckpointError

    problems = gguf_tokenizer_problems(path)
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    reader = open_gguf(path)
    tokens: list[str] = metadata(reader, "tokenizer.ggml.tokens")
    types: list[int] = metadata(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in metadata(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(GGUF_PRE_TOKENIZERS[metadata(reader, "tokenizer.ggml.pre", "default")])
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) are matched whole and skipped when decoding; user-defined ones
    # (<think>) are matched whole and kept, as llama.cpp treats them.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])

    def token(kind: str) -> Optional[str]:
        i = metadata(reader, f"tokenizer.ggml.{kind}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    add_bos = bool(metadata(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(metadata(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
        specials = [(t, tokens.index(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "chat_template": metadata(reader, "tokenizer.chat_template"),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    end_ids = [metadata(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return tok, config, sorted({int(i) for i in end_ids if i is not None})
