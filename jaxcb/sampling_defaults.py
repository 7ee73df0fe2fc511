"""The model's own defaults for the sampling fields a request leaves out.

A checkpoint's generation_config.json says how its authors meant it to be sampled (Llama 3.1
Instruct: temperature 0.6, top_p 0.9; Qwen2.5 Instruct: 0.7, 0.8, top_k 20, repetition_penalty
1.05). transformers' `generate` applies it, and so does vLLM by default (`--generation-config
auto`). jaxcb applies the same six fields, to HTTP bodies, job records, `LLM.generate` and
`Engine.add_request` alike, wherever a request leaves them out (or null); a value the request gives
always wins. A GGUF says the same in its `general.sampling.*` keys.

`model.generation_config`: auto (the checkpoint's) | none (jaxcb's own defaults: OpenAI's) | DIR
(a directory holding a generation_config.json).

    generation_config.json   GGUF key                  request field
    temperature              general.sampling.temp     temperature
    top_p                    general.sampling.top_p    top_p
    top_k                    general.sampling.top_k    top_k
    min_p                    general.sampling.min_p    min_p
    repetition_penalty       general.sampling.penalty_repeat (with penalty_last_n -1: the whole context)
                                                       repetition_penalty
    max_new_tokens           -                         max_tokens, when left out (chat: the room left
                                                       in the context, at most this; completions: 16,
                                                       at most this)

`do_sample: false` means greedy in transformers (its sampling fields unused): the default
temperature is then 0. What else either file sets that jaxcb does not apply as a default (beam
search, `no_repeat_ngram_size`, mirostat, ...) is named in a start-up warning, never dropped
unsaid.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from jaxcb.config import ConfigError, ModelConfig
from jaxcb.errors import InvalidRequestError
from jaxcb.sampling_params import SamplingParams

log = logging.getLogger(__name__)

APPLIED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
# generation_config.json keys that are not sampling defaults: token ids (the EOS ids are read with the
# tokenizer's, jaxcb.model_setup), bookkeeping, and limits max_model_len already sets.
_INERT = frozenset({
    "bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "transformers_version",
    "_from_model_config", "use_cache", "do_sample", "max_length", "cache_implementation", "return_dict_in_generate",
    "output_scores", "output_logits", "output_attentions", "output_hidden_states",
})
# Values of transformers' GenerationConfig that change nothing: a file that writes them out is not warned about.
_NEUTRAL = {
    "num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "length_penalty": 1.0, "diversity_penalty": 0.0,
    "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "encoder_repetition_penalty": 1.0, "min_length": 0, "min_new_tokens": None,
    "early_stopping": False, "renormalize_logits": False, "remove_invalid_values": False,
    "exponential_decay_length_penalty": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "bad_words_ids": None, "force_words_ids": None,
    "sequence_bias": None, "guidance_scale": None, "low_memory": None, "watermarking_config": None,
    "assistant_confidence_threshold": None, "num_assistant_tokens": None, "num_assistant_tokens_schedule": None,
    "penalty_alpha": None, "dola_layers": None, "token_healing": False, "stop_strings": None,
}
# A GGUF's sampling keys besides the applied ones, with the value that changes nothing.
_GGUF_NEUTRAL = {"mirostat": 0, "xtc_probability": 0.0}
_GGUF_KEYS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p"}


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a field out gets; None: jaxcb's own default (OpenAI's)."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    max_tokens: Optional[int] = None  # generation_config's max_new_tokens: at most this many when left out
    source: str = ""  # where they come from, for the start-up log

    def fill(self, field: str, value: Any, jaxcb_default: Any) -> Any:
        """A request's `field`: its own `value`, else the model's default, else jaxcb's."""
        if value is not None:
            return value
        model = getattr(self, field)
        return jaxcb_default if model is None else model

    def left_out_max_tokens(self, jaxcb_default: int) -> int:
        """max_tokens for a request that leaves it out: jaxcb's (16, or the room left in the context), at
        most the model's max_new_tokens."""
        return jaxcb_default if self.max_tokens is None else min(jaxcb_default, self.max_tokens)

    def params(self, **fields: Any) -> SamplingParams:
        """SamplingParams with these defaults under `fields` (what `LLM.generate` uses when given none)."""
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                fields.setdefault(name, getattr(self, name))
        if self.max_tokens is not None:
            fields.setdefault("max_tokens", self.left_out_max_tokens(SamplingParams.max_tokens))
        return SamplingParams(**fields)

    def describe(self) -> str:
        values = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                  if f.name != "source" and getattr(self, f.name) is not None]
        return ", ".join(values)

    @property
    def empty(self) -> bool:
        return not self.describe()


NO_DEFAULTS = SamplingDefaults()


def read_sampling_defaults(m: ModelConfig) -> SamplingDefaults:
    """The defaults `model.generation_config` names for `m`'s checkpoint; ConfigError naming the file and the
    field when one is not a value a request could give. Logs what it applies and what it does not."""
    where = m.generation_config
    if where == "none" or (where == "auto" and (m.init == "random" or not m.checkpoint)):
        return NO_DEFAULTS
    if where == "auto" and os.path.isfile(m.checkpoint) and m.checkpoint.endswith(".gguf"):
        defaults, ignored = _from_gguf(m.checkpoint)
    else:
        directory = m.checkpoint if where == "auto" else where
        path = os.path.join(directory, "generation_config.json")
        if not os.path.isfile(path):  # a checkpoint without one (a DIR without one is refused with the config)
            return NO_DEFAULTS
        defaults, ignored = _from_json(path)
    if not defaults.empty:
        log.info("sampling defaults from %s for the fields a request leaves out: %s (model.generation_config=none: "
                 "jaxcb's own)", defaults.source, defaults.describe())
    if ignored:
        log.warning("%s also sets %s, which jaxcb does not apply as request defaults (a request gives those "
                    "fields jaxcb has itself)", defaults.source or "the checkpoint", ", ".join(ignored))
    return defaults


def _from_json(path: str) -> tuple[SamplingDefaults, list[str]]:
    try:
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e}); fix it, or set model.generation_config=none") from None
    if not isinstance(gen, dict):
        raise ConfigError(f"{path} must hold a JSON object; fix it, or set model.generation_config=none")
    greedy = gen.get("do_sample") is False
    values = {name: gen.get(name) for name in APPLIED}
    if greedy:  # transformers then decodes greedily and its sampling fields go unused
        values = {"temperature": 0.0, "repetition_penalty": values["repetition_penalty"],
                  "max_new_tokens": values["max_new_tokens"]}
    ignored = [f"{k}={v!r}" for k, v in gen.items()
               if k not in APPLIED and k not in _INERT and (k not in _NEUTRAL or v != _NEUTRAL[k]) and v is not None]
    source = path + (" (do_sample=false: greedy)" if greedy else "")
    return _defaults(values, source), ignored


def _from_gguf(path: str) -> tuple[SamplingDefaults, list[str]]:
    from jaxcb.model.gguf import metadata, open_gguf

    reader = open_gguf(path)

    def key(name: str) -> Any:
        return metadata(reader, f"general.sampling.{name}")

    values: dict[str, Any] = {field: key(name) for name, field in _GGUF_KEYS.items()}
    ignored = []
    repeat, last_n = key("penalty_repeat"), key("penalty_last_n")
    if repeat is not None:
        if last_n == -1:  # over the whole context, as repetition_penalty counts the prompt and the output
            values["repetition_penalty"] = repeat
        elif repeat != 1.0:
            ignored.append(f"general.sampling.penalty_repeat={repeat!r} over the last "
                           f"{64 if last_n is None else last_n} tokens (repetition_penalty counts them all)")
    for name, neutral in _GGUF_NEUTRAL.items():
        if key(name) not in (None, neutral):
            ignored.append(f"general.sampling.{name}={key(name)!r}")
    return _defaults(values, f"{path}'s general.sampling keys"), ignored


def _defaults(values: dict[str, Any], source: str) -> SamplingDefaults:
    """The defaults, each checked and normalised as a request's own field is (by SamplingParams); a
    ConfigError naming the field where no request could give its value."""
    given = {("max_tokens" if key == "max_new_tokens" else key): v for key, v in values.items() if v is not None}
    try:
        params = SamplingParams(**given)
    except InvalidRequestError as e:
        named = "max_new_tokens" if e.field == "max_tokens" else e.field
        raise ConfigError(f"{source} sets a default no request could give ({named}): {e}; fix it, or set "
                          "model.generation_config=none") from None
    return SamplingDefaults(**{name: getattr(params, name) for name in given}, source=source)
