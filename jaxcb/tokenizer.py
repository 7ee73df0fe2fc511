"""Tokenizers: HF `tokenizers` for a checkpoint's tokenizer.json, bytes for the embedded tiny model.

Both expose the same small interface (`encode`, `decode`, `apply_chat_template`, special
ids). Chat templates are the checkpoint's own Jinja template from tokenizer_config.json,
rendered in a sandbox as transformers does; the byte tokenizer has a plain built-in one.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Optional, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: Optional[int]
    eos_token_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...


def render_chat_template(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool, **extra) -> str:
    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then <bos>=256, <eos>=257, <pad>=258."""

    BOS, EOS, PAD = 256, 257, 258

    def __init__(self) -> None:
        self.vocab_size = 259
        self.bos_token_id: Optional[int] = self.BOS
        self.eos_token_ids = [self.EOS]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS] + ids if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return render_chat_template(PLAIN_CHAT_TEMPLATE, messages, add_generation_prompt)


def _token_text(value: Any) -> Optional[str]:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config.json files
        return value.get("content")
    return value


class HFTokenizer:
    """A checkpoint's tokenizer.json (+ tokenizer_config.json for specials and the chat template)."""

    def __init__(self, directory: str):
        from tokenizers import Tokenizer as _Tokenizer

        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{directory} has no tokenizer.json; set model.tokenizer=DIR to one that has")
        self._tok = _Tokenizer.from_file(path)
        config: dict[str, Any] = {}
        config_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path) as f:
                config = json.load(f)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids = [eos_id] if eos_id is not None else []
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        self.chat_template: Optional[str] = template
        # tokenizer.json's post-processor decides BOS; add it ourselves only where the config asks and it is absent.
        self._add_bos = bool(config.get("add_bos_token", False))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        template = self.chat_template or PLAIN_CHAT_TEMPLATE
        return render_chat_template(
            template,
            messages,
            add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def load_tokenizer(directory: Optional[str]) -> Tokenizer:
    """The HF tokenizer in `directory`, or the byte-level one when there is none to load."""
    if directory is not None and os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return HFTokenizer(directory)
    return ByteTokenizer()


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of a chat rendered with the tokenizer's template, ready for the assistant's turn.

    HF chat templates write BOS themselves, so their text is encoded without adding it again."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=isinstance(tokenizer, ByteTokenizer))
