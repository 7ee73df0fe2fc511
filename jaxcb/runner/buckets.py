"""Step sizes: the short lists of token, sequence and block-table-width buckets compiled at start-up.

A step has three static sizes: tokens T, sequences R and block-table width W (a `Bucket`). Each
comes from a short list (config, or `default_token_buckets` -- denser on CPU, where padding
costs compute, densest for decode steps -- up to the limits; the token budget is always a
bucket, so a step never pads past it), and every (T, R, W) combination is compiled ahead of
time, once per step variant (`BucketKey`: the bucket and its `jaxcb.sampling.StepVariant`).

A step runs as two executables (`BucketKey.parts`): the model's, per bucket (`ModelKey`), and
the sampler's, per sequence bucket and sampling variant (`SamplerKey`), so that sampling, which
reads only the R rows that sample, compiles once per R and not once per token bucket.

R counts rows, not sequences: with speculative decoding a sequence verifying k drafts takes
1 + k rows, so each token bucket above `max_num_seqs` has a second row bucket,
min(T, max_num_seqs x (1 + k)) (`max_rows`): steps without drafts keep the smaller one, and form
no more logits than before.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from jaxcb.config import ConfigError, EngineConfig, SchedulerConfig
from jaxcb.kernels.attention.xla import GATHER_MAX_WIDTH
from jaxcb.sampling import StepVariant


class Bucket(NamedTuple):
    """One step size: a step's arrays are padded up to these."""

    num_tokens: int  # T: token rows (token_ids[T], positions[T], ...)
    num_seqs: int  # R: sequence rows (kv_lens[R], the sampling arrays [R], ...)
    table_width: int  # W: block-table columns, in blocks (block_tables[R, W])


class ModelKey(NamedTuple):
    """One compiled model step: a bucket's sizes, and whether it forms every token row's prompt logprobs."""

    num_tokens: int  # T
    num_seqs: int  # R
    table_width: int  # W, in blocks
    prompt_logprobs: bool

    @property
    def label(self) -> str:
        return "model, prompt-logprobs" if self.prompt_logprobs else "model"


class SamplerKey(NamedTuple):
    """One compiled sampling step: the rows that sample and what it computes of them."""

    num_seqs: int  # R
    variant: StepVariant  # GREEDY, RANDOM, FULL or MASKED (the prompt-logprobs variant samples masked)

    @property
    def label(self) -> str:
        return f"sampling {self.variant.label}"


class BucketKey(NamedTuple):
    """One step: a bucket's sizes and the variant it runs (a jit's static argument)."""

    num_tokens: int  # T
    num_seqs: int  # R
    table_width: int  # W, in blocks
    variant: StepVariant

    @property
    def model(self) -> ModelKey:
        # Every model step records the tokens' penalty counts, whatever the variant: a few scatters that
        # cost nothing next to the layers, and one model executable a bucket instead of one per variant.
        return ModelKey(self.num_tokens, self.num_seqs, self.table_width,
                        self.variant == StepVariant.PROMPT_LOGPROBS)

    @property
    def sampler(self) -> SamplerKey:
        return SamplerKey(self.num_seqs, min(self.variant, StepVariant.MASKED))

    @property
    def parts(self) -> tuple[ModelKey, SamplerKey]:
        """The executables the step runs, one after the other: the model's, then the sampler's."""
        return self.model, self.sampler


def powers_up_to(limit: int, base: int, start: int) -> list[int]:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= base
    return out + [limit]


@dataclasses.dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]
    seqs: tuple[int, ...]  # () -> one sequence bucket per token bucket: min(tokens, max_num_seqs)
    widths: tuple[int, ...]
    max_num_seqs: int
    max_rows: int = 0  # most rows a step has: max_num_seqs x (1 + k) with speculative decoding; 0: max_num_seqs

    def seqs_for(self, num_tokens_bucket: int) -> list[int]:
        t = num_tokens_bucket
        rows = {min(t, self.max_rows)} if self.max_rows > self.max_num_seqs else set()
        if not self.seqs:
            return sorted({min(t, self.max_num_seqs)} | rows)
        return sorted({min(r, t) for r in self.seqs} | rows)

    def all(self) -> list[Bucket]:
        return [Bucket(t, r, w) for t in self.tokens for r in self.seqs_for(t) for w in self.widths]

    def pick(self, num_tokens: int, num_seqs: int, width: int) -> Bucket:
        """The smallest bucket that holds a step of these sizes (`width`: its longest table, in blocks)."""
        t = next(b for b in self.tokens if b >= num_tokens)
        r = next(b for b in self.seqs_for(t) if b >= num_seqs)
        w = next(b for b in self.widths if b >= width)
        return Bucket(t, r, w)


def default_token_buckets(budget: int, platform: str, max_num_seqs: int, backend: str = "xla") -> list[int]:
    """On an accelerator a small step costs what reading the weights costs, padded or not, so
    powers of two from 16 keep the compile count low.

    On CPU the buckets start at 1, and `max_num_seqs` is one (a full decode batch, the step a busy
    engine runs most, pads nothing). Under the xla backend a step's time grows with its padded
    tokens (its matmuls are compute-bound from a few rows on), so up to `max_num_seqs` -- decode
    steps, one token a sequence -- they add the midpoints (x1.5) of every power of two: a padded
    token costs up to a third of a step instead of a half; above it, where steps prefill, powers of
    two: a chunk at the budget pads nothing, and every bucket costs start-up a compile of each eager
    step variant (~1.5 s a bucket for SmolLM2 on 2 cores). The cpu backend's matmuls, its LM head
    included, skip a step's padding rows, and attention reads only the real ones: a padded row costs
    next to nothing there, so its buckets are powers of four (SmolLM2 ran as fast as on powers of
    two, with 15 executables instead of 26; docs/perf-notes.md, "CPU token buckets")."""
    if platform != "cpu":
        return powers_up_to(budget, 2, min(16, budget))
    if backend == "cpu":
        return sorted(set(powers_up_to(budget, 4, 1)) | {min(max_num_seqs, budget)})
    powers = powers_up_to(budget, 2, 1)
    decode = [b for b in sorted(set(powers) | {p * 3 // 2 for p in powers}) if b < max_num_seqs]
    return sorted(set(decode) | {min(max_num_seqs, budget)} | {p for p in powers if p > max_num_seqs})


def make_buckets(
    engine: EngineConfig, sched: SchedulerConfig, max_blocks_per_seq: int, attention: str, platform: str | None = None,
    max_drafts: int = 0, backend: str = "xla",
) -> Buckets:
    """`attention`: the attention form's name (the xla form's cost follows the table width); `max_drafts`:
    speculative decoding's k (0: off); `backend`: the model backend's name (the cpu backend's matmuls skip
    padding rows)."""
    budget, max_seqs = sched.max_num_batched_tokens, sched.max_num_seqs
    # Checked here, where `auto` limits are resolved: a bucket no step can reach would be dropped unseen.
    if engine.seq_buckets and max(engine.seq_buckets) > max_seqs:
        raise ConfigError(f"engine.seq_buckets={engine.seq_buckets} has {max(engine.seq_buckets)}, above "
                          f"scheduler.max_num_seqs={max_seqs} (the limit in force); drop it or raise "
                          f"scheduler.max_num_seqs")
    if engine.context_buckets and max(engine.context_buckets) > max_blocks_per_seq:
        raise ConfigError(f"engine.context_buckets={engine.context_buckets} has {max(engine.context_buckets)} blocks, "
                          f"above the {max_blocks_per_seq} a sequence of engine.max_model_len tokens fills (widths are "
                          f"in blocks of cache.block_size tokens); drop it or raise engine.max_model_len")
    default = default_token_buckets(budget, platform or jax.default_backend(), max_seqs, backend)
    tokens = sorted(set(engine.token_buckets or default) | {budget})
    seqs = sorted(set(engine.seq_buckets) | {max_seqs}) if engine.seq_buckets else []
    if engine.context_buckets:
        widths = sorted(set(engine.context_buckets) | {max_blocks_per_seq})
    elif attention == "xla":
        # Tables up to GATHER_MAX_WIDTH blocks are gathered whole (cost follows the width); wider
        # ones are read pair by pair (cost follows the real context), so one more width is enough.
        widths = sorted({min(GATHER_MAX_WIDTH, max_blocks_per_seq), max_blocks_per_seq})
    else:  # the kernel and the reference read only up to each kv_len: no need to bucket
        widths = [max_blocks_per_seq]
    return Buckets(tuple(tokens), tuple(seqs), tuple(widths), max_seqs,
                   max_seqs * (1 + max_drafts))
