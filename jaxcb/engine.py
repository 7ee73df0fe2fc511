"""The engine: requests in, one scheduled step at a time, outputs out; and `LLM` for offline use.

Life of a request (docs/architecture.md has the whole picture):
  1. `add_request` validates it (prompt length, limits, sampling params), registers its group
     with the output processor and queues one sequence per completion (n > 1: the others share
     the first one's prompt blocks).
  2. each `step()`: the scheduler picks tokens for running and newly admitted sequences, the
     runner runs the compiled step and samples, the scheduler appends the tokens.
  3. the output processor (`output.py`) detokenizes them, decides every stop (tokens, length,
     strings) and returns a `RequestOutput` for every request that changed; the scheduler frees
     the blocks of the sequences that stopped.
  4. `abort` ends a request wherever it is and frees its blocks at once.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import numbers
import os
import random
import time
import weakref
from collections import abc, deque
from typing import Optional, Union

import jax
import numpy as np
from tqdm import tqdm

from jaxcb.core.block_hash import model_root
from jaxcb.core.block_pool import BlockPool
from jaxcb.config import Config, ConfigError, resolve_draft_model
from jaxcb.config_validation import validate_speculative_budget
from jaxcb.lora.manager import LoraManager
from jaxcb.model.lora import empty_lora_weights, slot_values
from jaxcb.core.host_prefix_cache import HostPrefixCache
from jaxcb.engine_stats import EMPTY_STEP, EngineStats
from jaxcb.beam_search import BeamSearchParams, EngineBeamSearches, beam_searches
from jaxcb.errors import EngineOverloadedError
from jaxcb.request_fields import is_text
from jaxcb.backends import select_backend
from jaxcb.batch_limits import cap_by_cache, check_step_fits, resolve_batch_limits
from jaxcb.kv_cache import (
    GIB,
    HostBlocks,
    allocate_planned_kv_cache,
    cache_block_growth,
    check_host_bytes,
    configure_device_memory,
    default_cache_dtype,
    format_bytes,
    num_swap_blocks,
    plan_kv_cache,
    read_device_memory,
    step_activation_bytes,
)
from jaxcb.kernels.attention.quantization import is_quantized
from jaxcb.kv_scales import KVScales, calibrated_kv_scales, checkpoint_has_kv_scales, resolve_kv_scales
from jaxcb.model.config import resolve_llama_config
from jaxcb.model_setup import load_model_and_tokenizer, weights_fingerprint
from jaxcb.sampling_defaults import read_sampling_defaults
from jaxcb.huge_pages import collapse_onto_huge_pages
from jaxcb.output import OutputKind, OutputProcessor, RequestGroup
from jaxcb.outputs import RequestOutput
from jaxcb.prompts import EncodedText, PromptType, prompt_text_and_ids, truncated_ids
from jaxcb.core.sequence import Sequence, SequenceId
from jaxcb.runner import ModelRunner, StepHandle, make_buckets
from jaxcb.runner.compiler import compile_plan
from jaxcb.sampling import StepVariant
from jaxcb.sampling_params import InvalidRequestError, SamplingParams, sample_seed
from jaxcb.core.scheduler import Scheduler
from jaxcb.core.proposers import Proposer
from jaxcb.core.speculation import Speculation
from jaxcb.draft_setup import load_draft_model
from jaxcb.runner.draft_runner import DraftProposer, DraftRunner
from jaxcb.sharding import initialize_distributed, make_tensor_parallel
from jaxcb.startup_log import StartupLog, report_memory
from jaxcb.startup_memory import check_weights_fit, weight_bytes
from jaxcb.structured import GrammarCompiler, TokenConstraint, bitmask_words
from jaxcb.structured.constraints import clear_tokens
from jaxcb.tokenizer import Tokenizer, read_chat_template_override
from jaxcb.validation import RequestLimits, validate_request

log = logging.getLogger(__name__)


def variant_needed(params: SamplingParams) -> Optional[StepVariant]:
    """The step variant a request cannot run without, where no sampling level stands in for it."""
    if params.prompt_logprobs is not None:
        return StepVariant.PROMPT_LOGPROBS
    if params.uses_masked_step:
        return StepVariant.MASKED
    return None


def compilation_cache_folder(directory: Optional[str]) -> str:
    """engine.compilation_cache_dir (null: ~/.cache/jaxcb/xla), created if it is not there."""
    setting = f"engine.compilation_cache_dir={directory}" if directory else "engine.compilation_cache_dir=null"
    directory = directory or os.path.join(os.path.expanduser("~"), ".cache", "jaxcb", "xla")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{setting}: {directory} cannot be created ({e.strerror or e}); give a folder this process "
                          f"can write") from e
    return directory


def enable_compilation_cache(directory: Optional[str]) -> str:
    directory = compilation_cache_folder(directory)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


def make_lora_manager(cfg: Config, arch) -> Optional[LoraManager]:
    """The engine's adapters, with lora.adapters loaded and checked; None when LoRA is off."""
    if not cfg.lora.enabled:
        return None
    from jaxcb.server.protocol import served_model_name

    manager = LoraManager(cfg.lora, arch, served_model_name(cfg))
    problems = []
    for name, path in cfg.lora.start_up_adapters.items():
        try:
            manager.load(name, path)
        except InvalidRequestError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("lora.adapters: " + " ".join(problems))
    log.info("LoRA: %d adapters loaded (%s), %d device slots of rank %d", len(manager.adapters),
             ", ".join(manager.adapters) or "none yet", cfg.lora.max_loras, cfg.lora.max_rank)
    return manager


def speculation_batch_size(cfg: Config, platform: str) -> int:
    """speculative.disable_by_batch_size resolved: most decoding sequences that speculate."""
    batch = cfg.speculative.disable_by_batch_size
    if batch != "auto":
        return batch
    if platform != "cpu":
        return 64
    # On the CPU n-gram speculation paid up to 32 decoding sequences and lost at 64 (docs/benchmarks.md,
    # "Where speculation stops paying"); a draft model's steps cost more, and its knee is not measured.
    return 32 if cfg.speculative.method == "ngram" else 8


def make_speculation(cfg: Config, platform: str, proposer: Optional[Proposer] = None) -> Optional[Speculation]:
    """The scheduler's proposer and back-off for `speculative.*`, or None when it is off (logged).
    `proposer`: the draft model's (method=draft); n-gram lookup otherwise."""
    sp = cfg.speculative
    if sp.method == "none":
        return None
    batch = speculation_batch_size(cfg, platform)
    how = (f"n-grams of {sp.prompt_lookup_min}..{sp.prompt_lookup_max} tokens" if sp.method == "ngram"
           else f"draft model {resolve_draft_model(sp.draft_model).name}")
    log.info("speculative decoding: %s, up to %d tokens a step (%s), while at most %d sequences decode",
             sp.method, sp.num_speculative_tokens, how, batch)
    return Speculation(sp, batch, proposer, costly=sp.method == "draft")


def kv_scales_for(cfg: Config, backend, weights, model_cfg, tokenizer, plan, tp, max_model_len: int
                  ) -> Optional[KVScales]:
    """An 8-bit cache's scales (`jaxcb.kv_scales`); None for an unquantized cache, whose checkpoint
    k_scale/v_scale, if any, are not needed (logged). Calibration prefills at most max_model_len
    tokens (the rotary table's length)."""
    if not is_quantized(plan.dtype):
        if cfg.model.init != "random" and checkpoint_has_kv_scales(cfg.model.checkpoint):
            log.info("the checkpoint's k_scale/v_scale are not used: cache.dtype=%s is not 8-bit", plan.dtype.name)
        return None

    def calibrate() -> KVScales:
        if cfg.cache.kv_calibration_tokens > max_model_len:
            log.info("cache.kv_calibration_tokens=%d: %d used, engine.max_model_len (the calibration prefill is one "
                     "sequence)", cfg.cache.kv_calibration_tokens, max_model_len)
        return calibrated_kv_scales(
            backend, weights, model_cfg, tokenizer, min(cfg.cache.kv_calibration_tokens, max_model_len),
            plan.block_size, plan.dtype,
            default_cache_dtype("auto", model_cfg.dtype), tp.kv_cache if tp is not None else None,
        )

    checkpoint = cfg.model.checkpoint if cfg.model.init != "random" else None
    return resolve_kv_scales(checkpoint, model_cfg, plan.dtype, calibrate=calibrate)


def check_against_model(cfg: Config, vocab_size: int) -> None:
    """What only the model's architecture bounds (model=hf reads it from the checkpoint), before any weight."""
    if cfg.engine.max_logprobs > vocab_size:
        raise ConfigError(f"engine.max_logprobs={cfg.engine.max_logprobs} must be <= the model's vocabulary of "
                          f"{vocab_size} tokens (model={cfg.model.name}); lower engine.max_logprobs")
    # Both widen every step's sampler inputs (a row each): past the vocabulary, a width only costs memory.
    if cfg.engine.max_stop_token_ids > vocab_size:
        raise ConfigError(f"engine.max_stop_token_ids={cfg.engine.max_stop_token_ids} must be <= the model's "
                          f"vocabulary of {vocab_size} tokens (model={cfg.model.name}): a row never bans more ids "
                          f"than there are; lower engine.max_stop_token_ids")
    if cfg.engine.max_logit_bias > max(vocab_size, 300):
        raise ConfigError(f"engine.max_logit_bias={cfg.engine.max_logit_bias} must be <= the model's vocabulary of "
                          f"{vocab_size} tokens (model={cfg.model.name}), or 300 (OpenAI's limit) where that is more: "
                          f"a request's logit_bias names each token at most once; lower engine.max_logit_bias")


def check_host_buffers(cfg: Config) -> None:
    """The host memory start-up allocates whole for blocks, against the machine, before anything is allocated."""
    c = cfg.cache
    if cfg.scheduler.preemption_mode == "swap":
        check_host_bytes(f"cache.swap_space_gib={c.swap_space_gib:g} (swap space)", int(c.swap_space_gib * GIB),
                         "lower cache.swap_space_gib")
    check_host_bytes(f"cache.host_prefix_cache_gib={c.host_prefix_cache_gib:g} (the prefix cache's host tier)",
                     int(c.host_prefix_cache_gib * GIB), "lower cache.host_prefix_cache_gib")


def lora_slot_bytes(cfg: Config, arch) -> tuple[int, str]:
    """(the adapters' slot buffers' bytes, the knobs that size them), before anything of LoRA is allocated
    (in the model's dtype, `Backend.lora_dtype`; stacked or not, the same bytes)."""
    lo = cfg.lora
    slots = jax.eval_shape(lambda: empty_lora_weights(arch, lo.max_loras, lo.max_rank, stacked=True, dtype=arch.dtype))
    return (sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(slots)),
            f"lora.max_loras={lo.max_loras} x lora.max_rank={lo.max_rank}")


def check_lora_slots_fit(cfg: Config, arch) -> None:
    """Where the device is the host (the CPU), the adapters' slot buffers against its memory."""
    slot_bytes, knobs = lora_slot_bytes(cfg, arch)
    check_host_bytes(f"{knobs} (the adapters' slots)", slot_bytes, "lower lora.max_loras or lora.max_rank")


class Engine:
    def __init__(self, cfg: Config, *, compile_buckets: bool = True, progress: bool = True):
        """Start-up, in the order `jaxcb.startup_memory.ENGINE_STARTUP_ORDER` models (each phase timed
        in `self.startup`): load the weights, prepare them, plan the KV cache from what is then free,
        allocate it, compile the steps."""
        self.cfg = cfg
        self.startup = StartupLog()
        initialize_distributed(cfg.engine.distributed)  # several hosts: before anything touches a device
        configure_device_memory(cfg.cache.memory_fraction)  # XLA's GPU pool: memory_fraction, not 75%
        enable_compilation_cache(cfg.engine.compilation_cache_dir)
        # The mesh, checked against the architecture before any weight is read.
        arch = resolve_llama_config(cfg.model)
        check_against_model(cfg, arch.vocab_size)
        check_host_buffers(cfg)
        # The checkpoint's defaults for the sampling fields a request leaves out: read (and checked) before any weight.
        self.sampling_defaults = read_sampling_defaults(cfg.model)
        tp_size = cfg.engine.tensor_parallel_size
        self.tp = make_tensor_parallel(tp_size, arch)
        self.max_model_len = cfg.engine.max_model_len or arch.max_position_embeddings
        if cfg.lora.enabled and read_device_memory() is None:  # no device memory reported: the slots are host memory
            check_lora_slots_fit(cfg, arch)
        self.lora = make_lora_manager(cfg, arch)  # start-up adapters read and checked before any weight
        if self.lora is not None:  # unloads and dropped host copies wait for an adapter's requests
            self.lora.in_use = self._adapter_in_use
        memory = read_device_memory()
        if memory is None and cfg.model.init == "random":  # the CPU: random weights past the machine, by their knobs
            check_host_bytes(f"model={cfg.model.name} (random {arch.dtype} weights of model.hidden_size, "
                             f"intermediate_size, num_layers and vocab_size)", weight_bytes(arch, tp_size).total,
                             "choose a smaller model or lower those sizes")
        if memory is not None:  # weights that cannot be loaded and prepared fail here, in a sentence
            backend = select_backend(cfg.model, arch, cfg.attention, mesh=self.tp.mesh if self.tp is not None else None)
            slots = None
            if cfg.lora.enabled:  # sharded as their layers are: each device holds its share
                slot_bytes, knobs = lora_slot_bytes(cfg, arch)
                slots = (slot_bytes // tp_size, knobs)
            check_weights_fit(arch, memory, backend.prepare_memory, self.max_model_len, tp_size, cfg.model.name,
                              slots)
        with self.startup.phase("load"):
            model, backend, self.tokenizer = load_model_and_tokenizer(cfg.model, cfg.attention, self.tp)
        if cfg.server.chat_template is not None:
            self.tokenizer.chat_template = read_chat_template_override(cfg.server.chat_template)
            log.info("chat template: server.chat_template (in place of the checkpoint's)")
        self.model_config = model_cfg = backend.cfg
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids or ())
        with self.startup.phase("prepare"):  # before the cache is planned: the prepare copy needs room
            weights = backend.prepare(model, self.max_model_len, self.tp.replicated if self.tp is not None else None)
            lora_buffers = None
            if self.lora is not None:  # the adapters' slots, planned with the weights, before the cache
                lora_buffers = empty_lora_weights(backend.cfg, cfg.lora.max_loras, cfg.lora.max_rank,
                                                  stacked=not backend.unroll_layers, dtype=backend.lora_dtype)
                weights = weights._replace(lora=backend.prepare_lora(lora_buffers))
                log.info("LoRA: %d slots of rank %d: %.1f MiB of slot buffers beside the weights", cfg.lora.max_loras,
                         cfg.lora.max_rank, sum(a.nbytes for a in jax.tree.leaves((lora_buffers, weights.lora)))
                         / 2**20)
            del model
            gc.collect()  # the checkpoint layout's arrays go now, so that the device's statistics show them gone
            # speculative.method=draft: the draft model, loaded and prepared the same way (its tokenizer checked).
            draft = (load_draft_model(cfg, model_cfg, self.tokenizer, self.max_model_len)
                     if cfg.speculative.method == "draft" else None)
            # After the checkpoint layout's arrays are gone: only the prepared weights' pages move.
            self.huge_pages = collapse_onto_huge_pages(
                jax.tree.leaves((weights, draft.weights if draft is not None else None)), cfg.engine.huge_pages,
                seconds=cfg.engine.huge_pages_seconds)
        with self.startup.phase("plan"):
            memory = read_device_memory()
            limits = resolve_batch_limits(cfg.scheduler, model_cfg, memory, memory_fraction=cfg.cache.memory_fraction,
                                          block_size=cfg.cache.block_size, tensor_parallel_size=tp_size,
                                          token_buckets=cfg.engine.token_buckets)
            if cfg.scheduler.max_num_batched_tokens == "auto":
                budget = limits.max_num_batched_tokens
                validate_speculative_budget(cfg.speculative, budget,
                                            f"scheduler.max_num_batched_tokens=auto ({budget} here)")
            workspace = step_activation_bytes(model_cfg, limits.max_num_batched_tokens, limits.max_num_seqs, tp_size)
            if draft is not None:  # the draft runner's buffers and steps, allocated after the cache
                workspace += draft.reserve_bytes(
                    cfg.cache.block_size, num_speculative_tokens=cfg.speculative.num_speculative_tokens,
                    max_proposals=min(limits.max_num_seqs, speculation_batch_size(cfg, jax.default_backend())),
                    max_num_batched_tokens=limits.max_num_batched_tokens)
            if cfg.cache.num_blocks is None:  # the cache is sized from what the workspace leaves
                check_step_fits(limits, workspace, memory, cfg.cache.memory_fraction)
            plan = plan_kv_cache(cfg.cache, model_cfg, max_model_len=self.max_model_len,
                                 max_num_seqs=limits.max_num_seqs, tensor_parallel_size=tp_size,
                                 reserve_bytes=workspace, memory=memory,
                                 extra_bytes_per_block=draft.bytes_per_block(cfg.cache.block_size) if draft else 0)
            limits = cap_by_cache(limits, cfg.scheduler, plan)
            backend.attention.check_cache_dtype(plan.dtype)  # an unsupported pairing fails before calibrating
            # An 8-bit cache's scales: the checkpoint's, or measured on the shipped text (jaxcb/kv_scales.py).
            self.kv_scales = kv_scales_for(cfg, backend, weights, model_cfg, self.tokenizer, plan, self.tp,
                                           self.max_model_len)
        if limits.reasons:
            log.info("%s", limits.describe())
        self.batch_limits = limits
        # The scheduler's limits in force (auto resolved); every component reads these, not cfg.scheduler.
        self.scheduler_config = sched_cfg = limits.apply(cfg.scheduler)
        self.cache_plan = plan
        self.block_pool = BlockPool(plan.num_blocks)
        # The root of every block hash: what the K/V depend on besides the tokens. Equal in every
        # process, restart and host that serves the same model the same way, so a router computes a
        # request's block hashes from it without the model: block_hash.block_hashes(token_ids,
        # cache_plan.block_size, prefix_cache_root, cache_salt).
        self.prefix_cache_root: bytes = model_root({
            "architecture": dataclasses.asdict(model_cfg), "weights": weights_fingerprint(cfg.model),
            "cache_dtype": plan.dtype.name, "block_size": plan.block_size,
            # An 8-bit cache's blocks hold K/V divided by its scales: other scales, other bytes.
            **({"kv_scales": self.kv_scales.digest()} if self.kv_scales is not None else {}),
        })
        with self.startup.phase("allocate"):
            kv_cache = allocate_planned_kv_cache(
                model_cfg, plan, self.tp.kv_cache if self.tp is not None else None, backend.attention.zeros_fn,
                None if self.kv_scales is None else (self.kv_scales.k, self.kv_scales.v),
            )
        host_pool = swap_space = None
        if sched_cfg.preemption_mode == "swap":
            num_host = num_swap_blocks(cfg.cache, plan)
            if num_host >= 2:
                host_pool = BlockPool(num_host)
                swap_space = HostBlocks(kv_cache, num_host, backend.attention.write_blocks_fn)
                log.info("swap space: %d host blocks (cache.swap_space_gib=%g), copied by %s", num_host - 1,
                         cfg.cache.swap_space_gib, swap_space.transfer)
            else:
                log.warning("cache.swap_space_gib=%g holds no block: preemption will recompute", cfg.cache.swap_space_gib)
        host_cache = host_tier = None
        num_tier = int(cfg.cache.host_prefix_cache_gib * GIB // plan.bytes_per_block)
        if cfg.cache.host_prefix_cache_gib > 0:
            if num_tier < 2:
                raise ConfigError(f"cache.host_prefix_cache_gib={cfg.cache.host_prefix_cache_gib:g} holds no "
                                  f"{format_bytes(plan.bytes_per_block)} block; raise it or set it to 0")
            host_cache = HostPrefixCache(num_tier)
            host_tier = HostBlocks(kv_cache, num_tier, backend.attention.write_blocks_fn)
            log.info("prefix cache host tier: %d blocks (%s, cache.host_prefix_cache_gib=%g), copied by %s",
                     num_tier - 1, format_bytes((num_tier - 1) * plan.bytes_per_block), cfg.cache.host_prefix_cache_gib,
                     host_tier.transfer)
        platform = jax.default_backend()
        max_drafts = cfg.speculative.num_speculative_tokens if cfg.speculative.method != "none" else 0
        max_blocks_per_seq = -(-self.max_model_len // plan.block_size)
        buckets = make_buckets(cfg.engine, sched_cfg, max_blocks_per_seq, backend.attention.name,
                               max_drafts=max_drafts, backend=backend.name)
        self.draft_runner = proposer = None
        if draft is not None:
            self.draft_runner = DraftRunner(
                draft.weights, draft.backend, num_blocks=plan.num_blocks, block_size=plan.block_size,
                cache_dtype=draft.cache_dtype, num_speculative_tokens=max_drafts,
                max_proposals=min(sched_cfg.max_num_seqs, speculation_batch_size(cfg, platform)),
                max_model_len=self.max_model_len, max_prev_rows=max(b.num_seqs for b in buckets.all()))
            proposer = DraftProposer(self.draft_runner, lambda: self.runner.last_hidden)
            del draft
        self.speculation = make_speculation(cfg, platform, proposer)
        self.scheduler = Scheduler(
            sched_cfg,
            self.block_pool,
            plan.block_size,
            self.max_model_len,
            enable_prefix_caching=cfg.cache.enable_prefix_caching,
            root=self.prefix_cache_root,
            host_pool=host_pool,
            block_growth=cache_block_growth(cfg.cache, backend.attention.name),
            speculation=self.speculation,
            lora_slots=self.lora.slots if self.lora is not None else None,
            host_cache=host_cache,
        )
        workers, when = compile_plan(cfg.engine, platform=platform)
        self.runner = ModelRunner(
            weights,
            backend,
            kv_cache,
            buckets,
            max_model_len=self.max_model_len,
            max_logprobs=cfg.engine.max_logprobs,
            max_stop_token_ids=cfg.engine.max_stop_token_ids,
            max_logit_bias=cfg.engine.max_logit_bias,
            sampling_variants=tuple(cfg.engine.sampling_variants),
            masked_sampling=cfg.engine.masked_sampling,
            prompt_logprobs=cfg.engine.prompt_logprobs,
            swap_space=swap_space,
            host_tier=host_tier,
            tp=self.tp,
            compile_workers=workers,
            compile_rare_variants=when,
            compile_inline=platform == "cpu",  # XLA:CPU: never a compile beside a step (runner/compiler.py)
            max_drafts=max_drafts,
            lora_buffers=lora_buffers,
            draft=self.draft_runner,
        )
        del weights, kv_cache, lora_buffers  # the runner holds them
        if compile_buckets:
            with self.startup.phase("compile"):
                self.runner.compile_all(progress=progress)
                if self.lora is not None:  # the slot writer, so that no adapter load compiles while serving
                    self._write_lora_slot(0, None)
        self.memory_report = report_memory(self.runner.weights, plan, workspace, self.runner.compiled.values(),
                                           read_device_memory())
        log.info("%s", self.memory_report)
        log.info("start-up: %s", self.startup.describe())
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.limits = RequestLimits(
            vocab_size=model_cfg.vocab_size, max_model_len=self.max_model_len, block_size=plan.block_size,
            num_usable_blocks=self.block_pool.num_blocks - 1, max_num_seqs=sched_cfg.max_num_seqs,
            max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
            enable_chunked_prefill=sched_cfg.enable_chunked_prefill, max_logprobs=cfg.engine.max_logprobs,
            max_stop_token_ids=cfg.engine.max_stop_token_ids, num_eos_token_ids=len(self.eos_token_ids),
            max_logit_bias=cfg.engine.max_logit_bias, masked_sampling=cfg.engine.masked_sampling,
            prompt_logprobs=cfg.engine.prompt_logprobs, max_n=cfg.server.max_n, scheduler_policy=sched_cfg.policy,
        )
        # Structured outputs: grammars compile (llguidance, loaded on first use) at most once per schema.
        self.grammars = GrammarCompiler(self.tokenizer, model_cfg.vocab_size, list(self.eos_token_ids),
                                        max_compile_s=cfg.engine.max_grammar_compile_s,
                                        cache_size=cfg.engine.grammar_cache_size)
        s = sched_cfg  # admission control: (limit, where it comes from), or None for none
        self.max_waiting_requests: Optional[tuple[int, str]] = (
            (s.max_waiting_requests, f"scheduler.max_waiting_requests={s.max_waiting_requests}")
            if s.max_waiting_requests is not None else None
        )
        self.max_waiting_tokens: Optional[tuple[int, str]] = (
            (s.max_waiting_tokens, f"scheduler.max_waiting_tokens={s.max_waiting_tokens}")
            if s.max_waiting_tokens is not None else None
        )
        self._seed_rng = random.Random(cfg.engine.seed)
        self._next_id = 0
        self._recent_steps: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens): throughput for hints
        self._in_flight: Optional[StepHandle] = None  # async scheduling: the dispatched, uncollected step
        self._num_dispatched = 0  # steps dispatched; the processed ones follow in the same order
        self._num_processed = 0
        self._aborted: list[str] = []  # request ids aborted since the last EngineStats
        # Requests whose step variant (masked, prompt-logprobs) is still compiling: (variant, sequences).
        self._held: list[tuple[StepVariant, list[Sequence]]] = []
        self.last_stats: EngineStats = self._snapshot(None)  # what the last step delivered
        # What start-up made (weights, compiled steps, tokenizer: hundreds of thousands of objects) lives
        # as long as the engine: out of the collector's sight, a full collection while serving does not
        # walk it again (as vLLM does). Measured on tiny: the host's share of a step shrinks by ~10%.
        gc.collect()
        gc.freeze()
        # Frozen objects are never collected, so when the engine goes they go back in the collector's
        # sight: the runner, the compiler and the compiled steps hold one another in cycles, and frozen
        # they outlived the engine, with their JIT code's memory maps (~1,300 a tiny engine), until a
        # process that built engine after engine (a test worker) hit the kernel's map limit.
        weakref.finalize(self, gc.unfreeze)

    # --- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        *,
        request_id: Optional[str] = None,
        priority: int = 0,
        final_only: bool = False,
        output_kind: Optional[OutputKind] = None,
        timeout_s: Optional[float] = None,
        queue_timeout_s: Optional[float] = None,
        cache_salt: Optional[str] = None,
        background: bool = False,
        lora: Optional[str] = None,
    ) -> str:
        """Queue a request; raise InvalidRequestError (nothing queued) if it can never be served.

        `output_kind`: what `step()` returns for it (`jaxcb.output.OutputKind`): CUMULATIVE (the
        default) after every step, DELTA only what is new (streams: the cost of a step does not grow
        with the output), FINAL_ONLY once, when it finishes (`final_only=True` says the same).
        `queue_timeout_s`: with nothing generated that long after now, it ends with finish_reason
        "queue_timeout" (the server answers 503); `timeout_s`: that long after now it ends with what
        it has, finish_reason "timeout". Either frees its blocks at once. `cache_salt` (a tenant's
        non-empty string): it shares cached prefix blocks only with requests that give the same salt
        (and no salt only with no salt). `background` (batch work): it yields to every other request,
        admitted after them and preempted first, whatever the scheduler's policy. `lora`: the name of a
        loaded LoRA adapter to run it with (as a request's `model` names it); None or the base model's name:
        the base model."""
        params = params or self.sampling_defaults.params()
        adapter = self._lora_adapter(lora)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt or not is_text(cache_salt)):
            raise InvalidRequestError(f"cache_salt={cache_salt!r} must be a non-empty string of valid Unicode, or "
                                      "left out", "cache_salt")
        for name, value in (("timeout_s", timeout_s), ("queue_timeout_s", queue_timeout_s)):
            # NaN would never compare past the deadline: the request would silently never time out.
            if value is not None and (not isinstance(value, numbers.Real) or isinstance(value, bool)
                                      or math.isnan(value)):
                raise InvalidRequestError(f"{name}={value!r} must be a number of seconds, or left out", name)
        try:
            # "delta" is no OutputKind: compared by identity, it would silently stream as CUMULATIVE.
            kind = (OutputKind(output_kind) if output_kind is not None
                    else OutputKind.FINAL_ONLY if final_only else OutputKind.CUMULATIVE)
        except ValueError:
            raise InvalidRequestError(f"output_kind={output_kind!r} must be one of "
                                      f"{[k.value for k in OutputKind]}", "output_kind") from None
        if request_id is None:
            # A caller's own id may be a number this counter reaches: skip it, rather than refuse a
            # request that named no id as a duplicate.
            while str(self._next_id) in self.output.groups:
                self._next_id += 1
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self.output.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
        text, ids = prompt_text_and_ids(prompt, self.tokenizer)
        text, ids = truncated_ids(prompt, text, ids, params.truncate_prompt_tokens, self.limits.max_model_len,
                                  self.tokenizer)
        validate_request(ids, params, self.limits, priority)
        self._admission_control(len(ids), params.n)
        new_constraint = self._constraint_factory(params)
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(32)
        now = time.monotonic()
        group = RequestGroup(
            request_id, text, list(ids), params, kind,
            queue_deadline=now + queue_timeout_s if queue_timeout_s is not None else None,
            deadline=now + timeout_s if timeout_s is not None else None,
        )
        for i in range(params.n):
            group.seqs.append(
                Sequence(
                    seq_id=SequenceId(request_id, i),  # never parsed, unique whatever the user's id
                    prompt_token_ids=list(ids),
                    sampling_params=params,
                    eos_token_ids=self.eos_token_ids,
                    priority=priority,
                    background=background,
                    seed=sample_seed(base_seed, i),
                    sample_index=i,
                    parent_id=group.seqs[0].seq_id if i else None,
                    cache_salt=cache_salt,
                    lora_name=adapter.name if adapter is not None else None,
                    lora_identity=self.lora.identity(adapter) if adapter is not None else None,
                    group_id=request_id,
                    constraint=new_constraint() if new_constraint is not None else None,
                )
            )
        self.output.add(group)
        if adapter is not None:
            self.lora.requests_per_adapter[adapter.name] += 1
        needed = variant_needed(params)
        if needed is not None and self.runner.compiler.serve(needed) is None:
            # Its step variant is still compiling (engine.compile_rare_variants): it waits, nothing else does.
            self._held.append((needed, group.seqs))
        else:
            for seq in group.seqs:
                self.scheduler.add_request(seq)
        return request_id

    def _lora_adapter(self, name: Optional[str]):
        """The adapter a request names, or None for the base; InvalidRequestError ("model") for an unknown name."""
        if self.lora is None:
            if name is not None and name != self.served_model_name:
                raise InvalidRequestError(f"model {name!r} is not served here: no LoRA adapters are loaded "
                                          "(lora.adapters)", "model")
            return None
        return self.lora.resolve(name)

    @property
    def served_model_name(self) -> str:
        from jaxcb.server.protocol import served_model_name

        return served_model_name(self.cfg)

    # --- LoRA adapters at run time ---------------------------------------------------------------

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a PEFT adapter that requests may then name; InvalidRequestError if it cannot be served."""
        if self.lora is None:
            raise InvalidRequestError("LoRA is not compiled in: start with lora.enable=true (or lora.adapters)",
                                      "lora_name")
        self.lora.load(name, path)

    def unload_lora_adapter(self, name: str) -> bool:
        """Refuse new requests for the adapter at once; it goes when its running requests finish (each
        step checks). True when it is gone already."""
        if self.lora is None:
            raise InvalidRequestError("LoRA is not compiled in: no adapter is loaded", "lora_name")
        return self.lora.unload(name)

    def _adapter_in_use(self, name: str) -> bool:
        return any(seq.lora_name == name for seq in self.scheduler.sequences.values()) or any(
            seq.lora_name == name for _, seqs in self._held for seq in seqs)

    def _write_lora_slot(self, slot: int, adapter_weights: Optional[dict]) -> None:
        backend = self.runner.backend
        self.runner.write_lora_slot(slot, slot_values(adapter_weights, self.model_config, self.cfg.lora.max_rank,
                                                      stacked=not backend.unroll_layers, dtype=backend.lora_dtype))

    def _release_held(self) -> None:
        """Queue the held requests whose step variant has become ready; forget aborted and expired ones."""
        held, self._held = self._held, []
        for needed, seqs in held:
            if seqs[0].group_id not in self.output.groups:
                continue
            if self.runner.compiler.serving(needed) is None:
                self._held.append((needed, seqs))
            else:
                for seq in seqs:
                    self.scheduler.add_request(seq)

    def _constraint_factory(self, params: SamplingParams):
        """A function making each sequence's TokenConstraint, or None when the params rule out no token.
        Compiles the grammar here unless the server already did (then it is a cache hit)."""
        if not params.uses_token_mask:
            return None
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs is not None else None
        bad_words_ids = self._bad_words_ids(params.bad_words)
        vocab = self.model_config.vocab_size
        gate = params.structured_outputs.after_reasoning if params.structured_outputs is not None else None
        make = lambda: TokenConstraint(vocab, grammar=grammar.matcher() if grammar is not None else None,  # noqa: E731
                                       allowed_token_ids=params.allowed_token_ids, bad_words_ids=bad_words_ids,
                                       after_reasoning=gate)
        self._check_some_first_token(params, make())
        return make

    def _check_some_first_token(self, params: SamplingParams, probe: TokenConstraint) -> None:
        """Refuse constraints that together allow no first token (the step would draw one anyway)."""
        row = np.empty(bitmask_words(self.model_config.vocab_size), np.int32)
        probe.fill(row)
        words = row.view(np.uint32)
        by_constraints = not words.any()
        if params.min_tokens > 0:  # the step bans EOS and the stop tokens until min_tokens are out
            clear_tokens(words, list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids)))
        if words.any():
            return
        used = [name for name, on in (("structured_outputs", params.structured_outputs is not None),
                                      ("allowed_token_ids", params.allowed_token_ids is not None),
                                      ("bad_words", bool(params.bad_words))) if on]
        if not by_constraints:
            raise InvalidRequestError(f"{' and '.join(used)} allow only EOS or stop tokens first, which "
                                      f"min_tokens={params.min_tokens} bans until it is reached; lower min_tokens "
                                      "or allow other tokens", "min_tokens")
        raise InvalidRequestError(f"{' and '.join(used)} together allow no first token; loosen one of them",
                                  used[-1])

    def _bad_words_ids(self, words: list[str]) -> list[tuple[int, ...]]:
        """Each bad word's tokens, as written and after a space (as vLLM forms them)."""
        out: list[tuple[int, ...]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        return out

    def enable_admission_control(self) -> None:
        """The server's protection (server.admission_control): where scheduler.max_waiting_requests /
        max_waiting_tokens set no limit, refuse (429) past 8 x scheduler.max_num_seqs waiting requests
        or twice the KV cache's tokens waiting. Offline use (LLM.generate, jobs) queues without bound."""
        s = self.scheduler_config
        if s.max_waiting_requests is None:
            self.max_waiting_requests = (
                8 * s.max_num_seqs, f"server.admission_control: 8 x scheduler.max_num_seqs={s.max_num_seqs}"
            )
        if s.max_waiting_tokens is None:
            self.max_waiting_tokens = (
                2 * self.cache_plan.num_tokens,
                f"server.admission_control: twice the KV cache's {self.cache_plan.num_tokens} tokens",
            )

    def _admission_control(self, num_prompt_tokens: int, n: int) -> None:
        """Refuse (retryably) a request that would overfill the queue; it costs nothing when refused."""
        waiting = len(self.scheduler.waiting) + self.num_held_sequences
        if self.max_waiting_requests is not None and waiting + n > self.max_waiting_requests[0]:
            limit, source = self.max_waiting_requests
            raise EngineOverloadedError(f"{waiting} requests are waiting, the limit is {limit} ({source})",
                                        self.retry_after_s())
        tokens = self.scheduler.num_waiting_tokens + self.num_held_tokens
        if self.max_waiting_tokens is not None and tokens + n * num_prompt_tokens > self.max_waiting_tokens[0]:
            limit, source = self.max_waiting_tokens
            raise EngineOverloadedError(
                f"{tokens} prompt tokens are waiting and this request brings {n * num_prompt_tokens}, the limit is "
                f"{limit} ({source})",
                self.retry_after_s(),
            )

    def retry_after_s(self) -> float:
        """Seconds until the waiting tokens are likely processed at the recent throughput (1 to 60)."""
        if len(self._recent_steps) < 2:
            return 1.0
        span = self._recent_steps[-1][0] - self._recent_steps[0][0]
        tokens_per_s = sum(t for _, t in list(self._recent_steps)[1:]) / max(span, 1e-6)
        return float(min(60, max(1, math.ceil(self.scheduler.num_waiting_tokens / max(tokens_per_s, 1e-6)))))

    def abort(self, request_id: str) -> bool:
        """End a request now and free its blocks; False if it is unknown or already finished."""
        group = self.output.remove(request_id)
        if group is None:
            return False
        self._aborted.append(request_id)
        for seq in group.seqs:
            self.scheduler.abort(seq.seq_id)
        return True

    @property
    def num_held_sequences(self) -> int:
        """Sequences held back until their step variant compiles (they count as waiting)."""
        return sum(len(seqs) for _, seqs in self._held)

    @property
    def num_held_tokens(self) -> int:
        return sum(len(seq.prompt_token_ids) for _, seqs in self._held for seq in seqs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output.groups) or self._in_flight is not None

    # --- steps ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; outputs of the requests that changed (finished ones for the last time).
        `step_with_stats` returns the same with a snapshot of the step they came from."""
        return self.step_with_stats()[0]

    def step_with_stats(self) -> tuple[list[RequestOutput], EngineStats]:
        """Run one iteration: (outputs of the requests that changed, the engine as that step left it).

        With engine.async_scheduling, the step scheduled and dispatched here runs on the device
        while the host collects and processes the previous one: the outputs returned are the
        previous step's, and so is the snapshot. Without it, the step is dispatched and collected here."""
        expired, stops = self.output.expire(time.monotonic())
        for seq, status in stops:
            self.scheduler.finish(seq.seq_id, status)
        self.runner.compiler.compile_wanted()  # inline (CPU): what the last request or step asked for
        if self._held:
            self._release_held()
        sched_out = self.scheduler.schedule()
        if self.lora is not None:  # the adapters this step's sequences took slots for, written before it runs
            self.lora.write_slots(self._write_lora_slot)
        handle = None
        if not sched_out.is_empty:
            handle = self.runner.dispatch(sched_out)
            self._num_dispatched += 1
            self.scheduler.commit(sched_out)
        elif sched_out.swap_out or sched_out.offload or sched_out.swap_in or sched_out.restore:
            self.runner.copy_blocks(sched_out)  # copies without a step to carry them
            self.runner.land_copies()
        elif self._in_flight is None and self.scheduler.num_unfinished:
            raise RuntimeError(
                f"the scheduler could not schedule any of {self.scheduler.num_unfinished} unfinished sequences "
                f"({self.block_pool.num_free_blocks} free blocks); this is a bug"
            )
        elif self._in_flight is None and self._held:  # only held requests: wait a little for their compile
            self.runner.compiler.wait({needed for needed, _ in self._held}, timeout=0.05)
        if self.cfg.engine.async_scheduling:
            handle, self._in_flight = self._in_flight, handle
        outputs = expired + (self._process(handle) if handle is not None else [])
        if self.lora is not None and self.lora.unloading:
            self.lora.finish_unloads()
        self.last_stats = self._snapshot(handle)
        return outputs, self.last_stats

    def _snapshot(self, handle: Optional[StepHandle]) -> EngineStats:
        """The engine's state now, with the figures of `handle`'s step (the one whose outputs go out)."""
        step = dict(EMPTY_STEP)
        if handle is not None:
            out = handle.scheduled
            num_tokens = out.num_scheduled_tokens
            num_prefill = sum(len(s.token_ids) for s in out.scheduled if s.start_position < s.num_prompt_tokens)
            self._num_processed += 1
            step = dict(step_index=self._num_processed, num_tokens=num_tokens,
                        num_padded_tokens=handle.bucket.num_tokens, num_prefill_tokens=num_prefill,
                        num_decode_tokens=num_tokens - num_prefill)
        sched = self.scheduler
        host_pool = sched.kv.host_pool  # None unless scheduler.preemption_mode=swap
        aborted, self._aborted = tuple(self._aborted), []
        return EngineStats(
            **step, num_running=len(sched.running), num_waiting=len(sched.waiting) + self.num_held_sequences,
            num_swapped=sum(1 for s in sched.waiting if s.host_block_ids) if host_pool is not None else 0,
            num_waiting_tokens=sched.num_waiting_tokens + self.num_held_tokens, kv_usage=self.block_pool.usage().usage,
            host_kv_usage=host_pool.usage().usage if host_pool is not None else 0.0,
            num_steps=self._num_dispatched, num_preemptions=sched.num_preemptions,
            prefix_cache_queries=sched.prefix_cache_queries, prefix_cache_hits=sched.prefix_cache_hits,
            num_recompiles=self.runner.num_recompiles, aborted_request_ids=aborted, **self._speculation_stats(),
            **self._lora_stats(),
            **self._host_tier_stats(),
        )

    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}
        sched, lo = self.scheduler, self.lora
        running = tuple(sorted({s.lora_name for s in sched.running if s.lora_name is not None}))
        waiting = tuple(sorted({s.lora_name for s in sched.waiting if s.lora_name is not None}))
        totals = tuple((name, lo.requests_per_adapter[name], lo.tokens_per_adapter[name])
                       for name in sorted(lo.requests_per_adapter))
        return dict(lora_running_adapters=running, lora_waiting_adapters=waiting, max_lora=lo.cfg.max_loras,
                    lora_totals=totals)


    def _host_tier_stats(self) -> dict:
        kv, tier = self.scheduler.kv, self.runner.host_tier
        if kv.host_cache is None:
            return {}
        return dict(host_prefix_cache_hits=kv.host_prefix_hits,
                    host_tier_bytes_to_host=kv.num_offloaded_blocks * tier.bytes_per_block,
                    host_tier_bytes_to_device=kv.num_restored_blocks * tier.bytes_per_block,
                    host_tier_evictions=kv.host_cache.num_evictions,
                    host_tier_usage=kv.host_cache.num_cached_blocks / (kv.host_cache.num_blocks - 1))

    def _speculation_stats(self) -> dict:
        if self.speculation is None:
            return {}
        s = self.speculation.stats
        return dict(spec_num_drafts=s.num_drafts, spec_num_draft_tokens=s.num_draft_tokens,
                    spec_num_accepted_tokens=s.num_accepted_tokens,
                    spec_accepted_per_position=tuple(s.accepted_per_position),
                    spec_num_unspeculated_requests=s.num_unspeculated_requests)

    def _process(self, handle: StepHandle) -> list[RequestOutput]:
        """Collect a dispatched step's tokens: the scheduler takes them, the output processor turns
        them into outputs and says which sequences stop, and those free their blocks now."""
        sched_out = handle.scheduled
        runner_out = self.runner.collect(handle)
        self._recent_steps.append((time.monotonic(), sched_out.num_scheduled_tokens))
        for seq_id, entries in runner_out.prompt_logprobs.items():
            seq = self.scheduler.sequences.get(seq_id)
            if seq is not None:
                self.output.record_prompt_logprobs(seq.group_id, entries)
        if self.lora is not None:  # tokens per adapter, for the metrics
            for seq_id, token in runner_out.sampled.items():
                seq = self.scheduler.sequences.get(seq_id)
                if seq is not None and seq.lora_name is not None:
                    self.lora.tokens_per_adapter[seq.lora_name] += len(runner_out.verified.get(seq_id, (token,)))
        outputs, stops = self.output.process(self.scheduler.update(sched_out, runner_out))
        for seq, status in stops:
            self.scheduler.finish(seq.seq_id, status)
        return outputs

    @property
    def num_recompiles(self) -> int:
        return self.runner.num_recompiles


_PROMPT_LISTS = (list, tuple, np.ndarray)  # a prompt's token ids, or the prompts; numpy's too


class LLM:
    """Offline generation: `LLM(cfg).generate(prompts, params)` -> outputs in input order."""

    def __init__(self, cfg: Config, **engine_kw):
        self.engine = Engine(cfg, **engine_kw)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams: the checkpoint's defaults (model.generation_config),
        else jaxcb's; change a field with `dataclasses.replace`."""
        return self.engine.sampling_defaults.params()

    def generate(
        self,
        prompts: Union[PromptType, abc.Sequence[PromptType]],
        sampling_params: Union[SamplingParams, abc.Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
        lora: Union[str, None, abc.Sequence[Optional[str]]] = None,
    ) -> list[RequestOutput]:
        """`lora`: the LoRA adapter (a loaded one's name, as a request's `model` names it) every prompt runs
        with, or one per prompt (None: the base model)."""
        if isinstance(prompts, (str, EncodedText)) or (isinstance(prompts, _PROMPT_LISTS) and len(prompts)
                                                       and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]  # one prompt, as text or token ids
        if not isinstance(prompts, _PROMPT_LISTS):
            raise InvalidRequestError(f"prompts must be a string, a list of token ids or a list of those, "
                                      f"not {type(prompts).__name__}", "prompt")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.engine.sampling_defaults.params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        if not (lora is None or isinstance(lora, (str, list, tuple))):
            raise ValueError(f"lora= must be an adapter's name, None or a list of them, not {type(lora).__name__}")
        adapters = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} LoRA adapters (lora=)")
        ids = []
        try:
            for prompt, params, adapter in zip(prompts, sampling_params, adapters):
                ids.append(self.engine.add_request(prompt, params, final_only=True, lora=adapter))
        except Exception:
            for rid in ids:  # nothing half-queued stays behind
                self.engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm, unit="req") as bar:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[rid] for rid in ids]

    def chat(
        self,
        messages: Union[abc.Sequence[dict], abc.Sequence[abc.Sequence[dict]]],
        sampling_params: Union[SamplingParams, abc.Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
        lora: Union[str, None, abc.Sequence[Optional[str]]] = None,
        tools: Optional[list[dict]] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: Optional[str] = None,
        chat_template_kwargs: Optional[dict] = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of OpenAI-style messages) or a list of them, each rendered as
        the server's chat endpoint renders it (the model's chat template, or server.chat_template, or
        `chat_template`: a template or a file's path; `tools` written in as the server writes them), then
        generated as `generate` does. Messages and tools are checked as a request body's are (InvalidRequestError
        naming the field). The outputs' text is the reply as generated: the chat endpoint reads tool calls and
        reasoning out of it, this does not."""
        import copy

        from jaxcb.server.chat import plan_chat
        from jaxcb.server.protocol import ChatCompletionRequest, parse_request
        from jaxcb.server.tool_parsers import get_tool_parser
        from jaxcb.tokenizer import tools_chat_template

        if not isinstance(messages, _PROMPT_LISTS) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of messages, or a list of such lists",
                                      "messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self.tokenizer
        if chat_template is not None:
            tokenizer = copy.copy(tokenizer)
            tokenizer.chat_template = read_chat_template_override(chat_template)
        srv = self.engine.cfg.server
        parser = get_tool_parser(srv.tool_call_parser, tools_chat_template(tokenizer))
        prompts = []
        for conversation in conversations:
            body = {"model": "offline", "messages": conversation, "add_generation_prompt": add_generation_prompt,
                    "continue_final_message": continue_final_message}
            if tools is not None:
                body["tools"] = tools
            if chat_template_kwargs is not None:
                body["chat_template_kwargs"] = chat_template_kwargs
            prompts.append(plan_chat(parse_request(ChatCompletionRequest, body), tokenizer, parser,
                                     srv.tool_prompt_fallback).prompt_ids)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora=lora)

    def beam_search(self, prompts: Union[PromptType, abc.Sequence[PromptType]], params: BeamSearchParams, *,
                    lora: Optional[str] = None, truncate_prompt_tokens: Optional[int] = None) -> list[RequestOutput]:
        """Beam search (vLLM's algorithm, `jaxcb.beam_search`) of each prompt: one RequestOutput each, whose
        `params.beam_width` outputs are its best beams, best first (vLLM's LLM.beam_search returns its own
        BeamSearchOutput instead). The prompts' rounds run side by side in the engine's steps."""
        if isinstance(prompts, (str, EncodedText)) or (isinstance(prompts, _PROMPT_LISTS) and len(prompts)
                                                       and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        searches = beam_searches(prompts, params, self.tokenizer, self.engine.max_model_len, self.engine.limits.max_n,
                                 truncate_prompt_tokens)
        driver = EngineBeamSearches(self.engine, searches, lora=lora)
        driver.start()
        try:
            while not driver.done:
                for out in self.engine.step():
                    if out.finished:
                        driver.take(out)
                driver.flush()
        except BaseException:
            driver.abort()
            raise
        return driver.results()
