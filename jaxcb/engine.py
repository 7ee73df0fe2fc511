"""The engine: requests in, one scheduled step at a time, outputs out; and `LLM` for offline use.

Life of a request:
  1. `add_request` validates it (prompt length, limits, sampling params) and queues one
     sequence per completion (n > 1: the others share the first one's prompt blocks).
  2. each `step()`: the scheduler picks tokens for running and newly admitted sequences, the
     runner runs the compiled step and samples, the scheduler appends the tokens and frees
     the blocks of sequences that stopped on a token.
  3. the engine detokenizes the new tokens, ends sequences that hit a stop string, and
     returns a `RequestOutput` for every request that changed.
  4. `abort` ends a request wherever it is and frees its blocks at once.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import jax
from tqdm import tqdm

from jaxcb.attention import check_cache_dtype
from jaxcb.block_pool import BlockPool
from jaxcb.config import Config
from jaxcb.detokenizer import IncrementalDetokenizer
from jaxcb.errors import EngineOverloadedError
from jaxcb.kv_cache import HostSwapSpace, allocate_planned_kv_cache, num_swap_blocks, plan_kv_cache
from jaxcb.model.config import resolve_llama_config
from jaxcb.model.llama import resolve_layer_loop, resolve_linear_impl
from jaxcb.model_setup import load_model_and_tokenizer
from jaxcb.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxcb.request import Request, RequestStatus
from jaxcb.runner import ModelRunner, make_buckets
from jaxcb.sampling_params import InvalidRequestError, SamplingParams
from jaxcb.scheduler import Scheduler
from jaxcb.sharding import initialize_distributed, make_tensor_parallel
from jaxcb.tokenizer import Tokenizer

log = logging.getLogger(__name__)
PromptType = Union[str, Sequence[int]]


def enable_compilation_cache(directory: Optional[str]) -> str:
    directory = directory or os.path.join(os.path.expanduser("~"), ".cache", "jaxcb", "xla")
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


@dataclass
class _Group:
    """The n sequences of one request, and their text."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    seqs: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    final_only: bool = False  # step() reports it only once it has finished
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class Engine:
    def __init__(self, cfg: Config, *, compile_buckets: bool = True, progress: bool = True):
        self.cfg = cfg
        initialize_distributed(cfg.engine.distributed)  # several hosts: before anything touches a device
        enable_compilation_cache(cfg.engine.compilation_cache_dir)
        # The mesh, checked against the architecture before any weight is read.
        self.tp = make_tensor_parallel(cfg.engine.tensor_parallel_size, resolve_llama_config(cfg.model))
        model, model_cfg, self.tokenizer = load_model_and_tokenizer(cfg.model, cfg.attention, self.tp)
        self.model_config = model_cfg
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids or ())
        self.max_model_len = cfg.engine.max_model_len or model_cfg.max_position_embeddings
        plan = plan_kv_cache(
            cfg.cache, model_cfg, max_model_len=self.max_model_len, max_num_seqs=cfg.scheduler.max_num_seqs,
            tensor_parallel_size=cfg.engine.tensor_parallel_size,
        )
        self.cache_plan = plan
        check_cache_dtype(model.attention, plan.dtype)
        self.block_pool = BlockPool(plan.num_blocks)
        kv_cache = allocate_planned_kv_cache(model_cfg, plan, self.tp.kv_cache if self.tp is not None else None)
        host_pool = swap_space = None
        if cfg.scheduler.preemption_mode == "swap":
            num_host = num_swap_blocks(cfg.cache, plan)
            if num_host >= 2:
                host_pool, swap_space = BlockPool(num_host), HostSwapSpace(kv_cache, num_host)
                log.info("swap space: %d host blocks (cache.swap_space_gib=%g)", num_host - 1, cfg.cache.swap_space_gib)
            else:
                log.warning("cache.swap_space_gib=%g holds no block: preemption will recompute", cfg.cache.swap_space_gib)
        self.scheduler = Scheduler(
            cfg.scheduler,
            self.block_pool,
            plan.block_size,
            self.max_model_len,
            enable_prefix_caching=cfg.cache.enable_prefix_caching,
            cache_salt=repr((cfg.model.name, cfg.model.checkpoint, cfg.model.seed, model_cfg, plan.dtype.name)),
            host_pool=host_pool,
        )
        max_blocks_per_seq = -(-self.max_model_len // plan.block_size)
        buckets = make_buckets(cfg.engine, cfg.scheduler, max_blocks_per_seq, model.attention.name)
        layer_loop = resolve_layer_loop(cfg.model.layer_loop)
        self.runner = ModelRunner(
            model,
            kv_cache,
            buckets,
            max_model_len=self.max_model_len,
            max_logprobs=cfg.engine.max_logprobs,
            max_stop_token_ids=cfg.engine.max_stop_token_ids,
            swap_space=swap_space,
            tp=self.tp,
            unroll_layers=layer_loop == "unrolled",
            pack_linear=resolve_linear_impl(
                cfg.model.linear_impl, dtype=model_cfg.dtype, layer_loop=layer_loop,
                tensor_parallel_size=cfg.engine.tensor_parallel_size,
            ) == "cpu",
        )
        if compile_buckets:
            self.runner.compile_all(progress=progress)
        self._groups: dict[str, _Group] = {}
        self._seed_rng = random.Random(cfg.engine.seed)
        self._next_id = 0
        self._recent_steps: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens): throughput for hints
        self._in_flight: Optional[tuple] = None  # async scheduling: the dispatched, uncollected step

    # --- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        *,
        request_id: Optional[str] = None,
        priority: int = 0,
        final_only: bool = False,
    ) -> str:
        """Queue a request; raise InvalidRequestError (nothing queued) if it can never be served.

        `final_only`: `step()` returns this request's output once, when it finishes, instead of
        after every step (offline generation, where nobody reads partial outputs: building them
        costs host time that grows with the output length)."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._validate(ids, params)
        self._admission_control(len(ids), params.n)
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(32)
        seqs = []
        for i in range(params.n):
            seqs.append(
                Request(
                    request_id=f"{request_id}#{i}" if params.n > 1 else request_id,
                    prompt_token_ids=list(ids),
                    sampling_params=params,
                    eos_token_ids=self.eos_token_ids,
                    priority=priority,
                    seed=(base_seed + 0x9E3779B1 * i) & 0xFFFFFFFF,
                    sample_index=i,
                    parent_id=seqs[0].request_id if i else None,
                )
            )
        group = _Group(
            request_id, text, list(ids), seqs, [IncrementalDetokenizer(self.tokenizer, params.stop) for _ in seqs],
            final_only=final_only,
        )
        self._groups[request_id] = group
        for seq in seqs:
            self.scheduler.add_request(seq)
        return request_id

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"engine.max_model_len={self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        blocks = -(-(len(ids) + params.max_tokens) // self.cache_plan.block_size)
        if blocks > self.block_pool.num_blocks - 1:
            raise InvalidRequestError(
                f"prompt + max_tokens needs {blocks} KV blocks but the whole cache has {self.block_pool.num_blocks - 1}"
            )
        sched = self.cfg.scheduler
        if not sched.enable_chunked_prefill and len(ids) > sched.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens exceeds scheduler.max_num_batched_tokens={sched.max_num_batched_tokens} "
                f"and scheduler.enable_chunked_prefill=false"
            )
        if params.logprobs is not None and params.logprobs > self.cfg.engine.max_logprobs:
            raise InvalidRequestError(f"logprobs={params.logprobs} exceeds engine.max_logprobs={self.cfg.engine.max_logprobs}")
        num_banned = len(params.stop_token_ids) + len(self.eos_token_ids)
        if params.min_tokens and num_banned > self.cfg.engine.max_stop_token_ids:
            raise InvalidRequestError(
                f"min_tokens with {num_banned} EOS + stop token ids exceeds "
                f"engine.max_stop_token_ids={self.cfg.engine.max_stop_token_ids}"
            )
        if params.n > sched.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} exceeds scheduler.max_num_seqs={sched.max_num_seqs}")

    def _admission_control(self, num_prompt_tokens: int, n: int) -> None:
        """Refuse (retryably) a request that would overfill the queue; it costs nothing when refused."""
        s = self.cfg.scheduler
        waiting = len(self.scheduler.waiting)
        if s.max_waiting_requests is not None and waiting + n > s.max_waiting_requests:
            raise EngineOverloadedError(
                f"{waiting} requests are waiting, the limit is scheduler.max_waiting_requests={s.max_waiting_requests}",
                self.retry_after_s(),
            )
        tokens = self.scheduler.num_waiting_tokens
        if s.max_waiting_tokens is not None and tokens + n * num_prompt_tokens > s.max_waiting_tokens:
            raise EngineOverloadedError(
                f"{tokens} prompt tokens are waiting and this request brings {n * num_prompt_tokens}, the limit is "
                f"scheduler.max_waiting_tokens={s.max_waiting_tokens}",
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
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for seq in group.seqs:
            self.scheduler.abort(seq.request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or self._in_flight is not None

    # --- steps ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; outputs of the requests that changed (finished ones for the last time).

        With engine.async_scheduling, the step scheduled and dispatched here runs on the device
        while the host collects and processes the previous one: the outputs returned are the
        previous step's. Without it, the step is dispatched and collected here."""
        sched_out = self.scheduler.schedule()
        handle = None
        if not sched_out.is_empty:
            handle = self.runner.dispatch(sched_out)
            self.scheduler.commit(sched_out)
        elif self._in_flight is None and self.scheduler.num_unfinished:
            raise RuntimeError(
                f"the scheduler could not schedule any of {self.scheduler.num_unfinished} unfinished sequences "
                f"({self.block_pool.num_free_blocks} free blocks); this is a bug"
            )
        if not self.cfg.engine.async_scheduling:
            return self._process(handle) if handle is not None else []
        previous, self._in_flight = self._in_flight, handle
        return self._process(previous) if previous is not None else []

    def _process(self, handle: tuple) -> list[RequestOutput]:
        """Collect a dispatched step's tokens and turn them into outputs."""
        sched_out = handle[0]
        runner_out = self.runner.collect(handle)
        self._recent_steps.append((time.monotonic(), sched_out.num_scheduled_tokens))
        changed: dict[str, _Group] = {}
        for seq, token in self.scheduler.update(sched_out, runner_out):
            group_id = seq.request_id.split("#")[0] if seq.sampling_params.n > 1 else seq.request_id
            group = self._groups.get(group_id)
            if group is None:
                continue
            detok = group.detokenizers[seq.sample_index]
            stop = detok.add_token(token)
            if stop is not None and not seq.is_finished:
                self.scheduler.finish(seq.request_id, RequestStatus.FINISHED_STOPPED)
            if seq.is_finished:
                detok.finish()
            changed[group_id] = group
        outputs = []
        for group_id, group in changed.items():
            finished = group.finished
            if finished or not group.final_only:
                outputs.append(self._output(group))
            if finished:
                del self._groups[group_id]
        return outputs

    def _output(self, group: _Group) -> RequestOutput:
        completions = []
        for seq, detok in zip(group.seqs, group.detokenizers):
            want_logprobs = seq.sampling_params.logprobs is not None
            completions.append(
                CompletionOutput(
                    index=seq.sample_index,
                    # while running: without a tail that may still turn into a stop string
                    text=detok.text if seq.is_finished else detok.stream_text,
                    token_ids=list(seq.output_token_ids[: len(detok.token_ids)]),
                    finish_reason=seq.status.value if seq.is_finished else None,
                    logprobs=list(seq.output_logprobs) if want_logprobs else None,
                )
            )
        first = group.seqs[0]
        metrics = RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time, first.finished_time)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, group.finished, metrics)

    @property
    def num_recompiles(self) -> int:
        return self.runner.num_recompiles


class LLM:
    """Offline generation: `LLM(cfg).generate(prompts, params)` -> outputs in input order."""

    def __init__(self, cfg: Config, **engine_kw):
        self.engine = Engine(cfg, **engine_kw)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or token ids
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                ids.append(self.engine.add_request(prompt, params, final_only=True))
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
