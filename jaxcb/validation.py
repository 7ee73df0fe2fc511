"""Where a request is validated: `validate_request`, which every way in calls through
`Engine.add_request` -- the HTTP server, JSONL jobs, the Ray replicas and `LLM.generate`.

One path in, whatever the door: an HTTP body or a JSONL job record is parsed by the same
protocol models (`server/protocol.py`: types and shapes, unknown fields refused by name) into
a `SamplingParams`, which checks every range (`LLM.generate` starts there); what depends on
the engine -- the vocabulary, the model length, the cache, the limits in the config -- is
checked here, once, with a sentence that says what to change. Every refusal is an
`InvalidRequestError` whose `field` names the request field, so the same field with the same
value gets the same answer from every door. Nothing is queued when a check fails. No jax.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxcb.errors import InvalidRequestError
from jaxcb.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What one engine can serve, fixed at start-up."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_usable_blocks: int  # the whole cache, without the null block
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_logprobs: int
    max_stop_token_ids: int
    num_eos_token_ids: int
    max_logit_bias: int = 300
    masked_sampling: bool = True
    prompt_logprobs: bool = True  # the prompt-logprobs step variant is compiled
    max_n: int = 16  # server.max_n: completions per request at most
    scheduler_policy: str = "fcfs"  # priority is honoured only by scheduler.policy=priority


def validate_request(ids: list[int], params: SamplingParams, limits: RequestLimits, priority: int = 0) -> None:
    """Raise InvalidRequestError naming the field if the prompt `ids` with `params` can never be served here."""
    vocab = limits.vocab_size
    if not ids:
        raise InvalidRequestError("the prompt is empty; give at least one token", "prompt")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt")
    if len(ids) + params.max_tokens > limits.max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"engine.max_model_len={limits.max_model_len}; shorten the prompt or lower max_tokens", "max_tokens"
        )
    blocks = -(-(len(ids) + params.max_tokens) // limits.block_size)
    if blocks > limits.num_usable_blocks:
        raise InvalidRequestError(
            f"prompt + max_tokens needs {blocks} KV blocks but the whole cache has {limits.num_usable_blocks}",
            "max_tokens",
        )
    if not limits.enable_chunked_prefill and len(ids) > limits.max_num_batched_tokens:
        raise InvalidRequestError(
            f"prompt of {len(ids)} tokens exceeds scheduler.max_num_batched_tokens={limits.max_num_batched_tokens} "
            f"and scheduler.enable_chunked_prefill=false", "prompt"
        )
    if params.logprobs is not None and params.logprobs > limits.max_logprobs:
        raise InvalidRequestError(f"logprobs={params.logprobs} exceeds engine.max_logprobs={limits.max_logprobs}",
                                  "logprobs")
    if params.prompt_logprobs is not None:
        if params.prompt_logprobs > limits.max_logprobs:
            raise InvalidRequestError(f"prompt_logprobs={params.prompt_logprobs} exceeds "
                                      f"engine.max_logprobs={limits.max_logprobs}", "prompt_logprobs")
        if not limits.prompt_logprobs:
            raise InvalidRequestError("prompt_logprobs needs the prompt-logprobs step variant, which this engine did "
                                      "not compile (engine.prompt_logprobs=false); start it with "
                                      "engine.prompt_logprobs=true", "prompt_logprobs")
    num_banned = len(params.stop_token_ids) + limits.num_eos_token_ids
    if params.min_tokens and num_banned > limits.max_stop_token_ids:
        raise InvalidRequestError(
            f"min_tokens with {num_banned} EOS + stop token ids exceeds "
            f"engine.max_stop_token_ids={limits.max_stop_token_ids}", "stop_token_ids"
        )
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise InvalidRequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                                  "stop_token_ids")
    _validate_constraints(params, limits)
    max_n = min(limits.max_n, limits.max_num_seqs)
    if params.n > max_n:
        source = (f"server.max_n={limits.max_n}" if limits.max_n <= limits.max_num_seqs
                  else f"scheduler.max_num_seqs={limits.max_num_seqs}")
        raise InvalidRequestError(f"n={params.n} exceeds {source}; ask for at most {max_n} completions", "n")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority={priority!r} must be an integer", "priority")
    if not -(2**63) <= priority < 2**63:  # the scheduler ages it in floats: past these it would not convert
        raise InvalidRequestError("priority must be a 64-bit integer (from -2**63 to 2**63 - 1)", "priority")
    if priority != 0 and limits.scheduler_policy != "priority":
        raise InvalidRequestError(
            f"priority={priority} is used only by scheduler.policy=priority; this engine runs "
            f"scheduler.policy={limits.scheduler_policy}, so drop priority or start it with scheduler.policy=priority",
            "priority",
        )


def _validate_constraints(params: SamplingParams, limits: RequestLimits) -> None:
    vocab = limits.vocab_size
    if params.uses_masked_step and not limits.masked_sampling:
        fields = [name for name, used in (
            ("structured outputs", params.structured_outputs is not None),
            ("allowed_token_ids", params.allowed_token_ids is not None), ("bad_words", bool(params.bad_words)),
            ("logit_bias", bool(params.logit_bias))) if used]
        raise InvalidRequestError(
            f"{', '.join(fields)} need the masked step variants, which this engine did not compile "
            f"(engine.masked_sampling=false); start it with engine.masked_sampling=true",
            fields[0].replace("structured outputs", "structured_outputs"),
        )
    for name, ids in (("allowed_token_ids", params.allowed_token_ids or ()), ("logit_bias", params.logit_bias or {})):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab})", name)
    if params.logit_bias and len(params.logit_bias) > limits.max_logit_bias:
        raise InvalidRequestError(
            f"logit_bias has {len(params.logit_bias)} entries; engine.max_logit_bias={limits.max_logit_bias} at most",
            "logit_bias",
        )
