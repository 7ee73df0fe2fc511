"""The checks a Config must pass at start-up, beyond what the dataclass types express: ranges,
choices and cross-field contradictions. Each failure is a ConfigError whose sentence names the
fields and says what to change.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

from jaxcb.batch_limits import validate_batch_limits
from jaxcb.config import (
    BACKENDS,
    CACHE_DTYPES,
    DTYPES,
    LAYER_LOOPS,
    SUPPORTED_BLOCK_SIZES,
    Config,
    ConfigError,
    DistributedConfig,
    ModelConfig,
    RopeScalingConfig,
    ServerConfig,
    SpeculativeConfig,
    resolve_draft_model,
)


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate_batch_and_tracing_config(srv: ServerConfig) -> None:
    """server.batch_dir, server.max_file_bytes (/v1/files, /v1/batches) and server.otlp_endpoint (tracing)."""
    require(bool(srv.batch_dir), "server.batch_dir must name a folder for /v1/files and /v1/batches")
    found = os.path.abspath(srv.batch_dir)  # made by the first upload: what is already there must be a folder
    while not os.path.exists(found) and os.path.dirname(found) != found:
        found = os.path.dirname(found)
    require(os.path.isdir(found), f"server.batch_dir={srv.batch_dir} cannot be a folder: {found} is a file; give a "
                                  f"folder for /v1/files and /v1/batches")
    require(srv.max_file_bytes >= srv.max_request_bytes,
            f"server.max_file_bytes={srv.max_file_bytes} must be >= server.max_request_bytes={srv.max_request_bytes} "
            "(a batch file holds request bodies)")
    endpoint = srv.otlp_endpoint
    require(endpoint is None or (isinstance(endpoint, str) and endpoint.startswith(("http://", "https://"))
                                 and len(endpoint.split("://", 1)[1]) > 0),
            f"server.otlp_endpoint={endpoint!r} must be an http:// or https:// URL of an OTLP/HTTP collector "
            "(e.g. http://127.0.0.1:4318/v1/traces), or null for no tracing")


def validate_text_fields(cfg: Config) -> None:
    """The text knobs that an empty string would silently turn into something else: a default, every network
    interface, or a key that guards nothing."""
    for where, value, instead in (
        ("model.name", cfg.model.name, "a name (the served model's, unless server.served_model_name is set)"),
        ("engine.compilation_cache_dir", cfg.engine.compilation_cache_dir, "a folder, or null for ~/.cache/jaxcb/xla"),
        ("server.host", cfg.server.host, "the address to listen on (127.0.0.1: this machine only; 0.0.0.0: every "
                                         "interface)"),
        ("server.served_model_name", cfg.server.served_model_name,
         "the name requests give, or null for model.name (the checkpoint's folder for model=hf)"),
        ("server.api_key", cfg.server.api_key, "a key, or null to serve /v1/* without one"),
        ("ray.address", cfg.ray.address, "auto or ray://HOST:10001 to join a cluster, or null to start one here"),
    ):
        require(value is None or value.strip() != "", f"{where}={value!r} is empty; give {instead}")


def _non_finite(node: Any, path: str = "") -> list[str]:
    """The float fields (at any depth) holding NaN or an infinity: no knob takes one (null is "none")."""
    if isinstance(node, float):
        return [] if math.isfinite(node) else [f"{path}={node}"]
    if dataclasses.is_dataclass(node):
        items = ((f.name, getattr(node, f.name)) for f in dataclasses.fields(node))
    elif isinstance(node, dict):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    else:
        return []
    return [bad for key, value in items for bad in _non_finite(value, f"{path}.{key}" if path else str(key))]


def validate_config(cfg: Config) -> None:
    """Cross-field and range checks that the dataclass types cannot express."""
    bad = _non_finite(cfg)
    require(not bad, f"{', '.join(bad)}: not a finite number; give a number (or null where the field takes none)")
    validate_model_config(cfg.model)
    validate_text_fields(cfg)
    c, s, e, srv = cfg.cache, cfg.scheduler, cfg.engine, cfg.server
    require(
        c.block_size in SUPPORTED_BLOCK_SIZES,
        f"cache.block_size={c.block_size} must be one of {list(SUPPORTED_BLOCK_SIZES)}",
    )
    require(
        c.num_blocks is None or c.num_blocks >= 2,
        f"cache.num_blocks={c.num_blocks} must be >= 2 (block 0 is reserved), or null to size from memory",
    )
    require(
        0.0 < c.memory_fraction <= 1.0,
        f"cache.memory_fraction={c.memory_fraction} must be in (0, 1]",
    )
    require(
        c.cpu_kv_cache_gib > 0,
        f"cache.cpu_kv_cache_gib={c.cpu_kv_cache_gib} must be > 0",
    )
    require(
        c.block_growth is None or c.block_growth >= 1,
        f"cache.block_growth={c.block_growth} must be >= 1, or null (4 with attention.impl=cpu, else 1)",
    )
    require(
        c.dtype in CACHE_DTYPES,
        f"cache.dtype={c.dtype!r} must be one of {list(CACHE_DTYPES)}",
    )
    require(
        c.kv_calibration_tokens >= 16,
        f"cache.kv_calibration_tokens={c.kv_calibration_tokens} must be >= 16 (the tokens an 8-bit cache's "
        f"scales are measured on)",
    )
    require(
        cfg.attention.impl in ("auto", "pallas", "cpu", "xla", "reference"),
        f"attention.impl={cfg.attention.impl!r} must be one of auto, pallas, cpu, xla, reference",
    )
    validate_batch_limits(s, c.block_size, e.token_buckets)
    require(
        s.policy in ("fcfs", "priority", "static"),
        f"scheduler.policy={s.policy!r} must be one of fcfs, priority, static",
    )
    require(
        s.preemption_mode in ("recompute", "swap"),
        f"scheduler.preemption_mode={s.preemption_mode!r} must be recompute or swap",
    )
    require(c.swap_space_gib >= 0, f"cache.swap_space_gib={c.swap_space_gib} must be >= 0")
    require(c.host_prefix_cache_gib >= 0, f"cache.host_prefix_cache_gib={c.host_prefix_cache_gib} must be >= 0")
    require(c.host_prefix_cache_gib == 0 or c.enable_prefix_caching,
            f"cache.host_prefix_cache_gib={c.host_prefix_cache_gib} keeps prefix-cache blocks, but "
            "cache.enable_prefix_caching=false; turn prefix caching on or set cache.host_prefix_cache_gib=0")
    require(s.priority_aging_s > 0, f"scheduler.priority_aging_s={s.priority_aging_s} must be > 0")
    for name in ("max_waiting_requests", "max_waiting_tokens"):
        v = getattr(s, name)
        require(v is None or v >= 1, f"scheduler.{name}={v} must be >= 1, or null for no limit")
    require(
        s.long_prefill_token_threshold is None or s.long_prefill_token_threshold >= 1,
        f"scheduler.long_prefill_token_threshold={s.long_prefill_token_threshold} must be >= 1, or null for no cap",
    )
    require(
        s.long_prefill_token_threshold is None or s.enable_chunked_prefill,
        f"scheduler.long_prefill_token_threshold={s.long_prefill_token_threshold} splits prefills into chunks, but "
        f"scheduler.enable_chunked_prefill=false runs each whole in one step; drop one of them",
    )
    require(
        s.max_num_partial_prefills >= 1,
        f"scheduler.max_num_partial_prefills={s.max_num_partial_prefills} must be >= 1",
    )
    require(
        e.max_model_len is None or e.max_model_len >= 1,
        f"engine.max_model_len={e.max_model_len} must be >= 1, or null for the model's limit",
    )
    if e.max_model_len is not None and cfg.model.max_position_embeddings is not None:
        require(
            e.max_model_len <= cfg.model.max_position_embeddings,
            f"engine.max_model_len={e.max_model_len} must be <= "
            f"model.max_position_embeddings={cfg.model.max_position_embeddings}",
        )
    for name in ("token_buckets", "seq_buckets", "context_buckets"):
        buckets = getattr(e, name)
        require(
            buckets is None or (len(buckets) > 0 and all(b >= 1 for b in buckets)),
            f"engine.{name}={buckets} must be a non-empty list of positive sizes, or null for the default",
        )
    require(e.max_logprobs >= 1, f"engine.max_logprobs={e.max_logprobs} must be >= 1")
    require(e.max_stop_token_ids >= 0,
            f"engine.max_stop_token_ids={e.max_stop_token_ids} must be >= 0 (0: a request with min_tokens is refused)")
    require(e.max_logit_bias >= 1, f"engine.max_logit_bias={e.max_logit_bias} must be >= 1")
    levels = ("greedy", "random", "full")
    require(set(e.sampling_variants) <= set(levels) and "full" in e.sampling_variants,
            f"engine.sampling_variants={list(e.sampling_variants)} must list some of {list(levels)}, full included "
            f"(full serves every request; the others only make some steps cheaper)")
    require(e.compile_workers == "auto" or (isinstance(e.compile_workers, int) and e.compile_workers >= 1),
            f"engine.compile_workers={e.compile_workers!r} must be a positive number of threads, or auto")
    require(e.compile_rare_variants in ("auto", "startup", "background", "first_use"),
            f"engine.compile_rare_variants={e.compile_rare_variants!r} must be one of auto, startup, background, "
            f"first_use")
    require(e.huge_pages in ("auto", "off"),
            f"engine.huge_pages={e.huge_pages!r} must be auto (the weights on 2 MiB pages where a CPU host allows) "
            f"or off")
    require(e.huge_pages_seconds > 0, f"engine.huge_pages_seconds={e.huge_pages_seconds} must be > 0 seconds "
                                      f"(engine.huge_pages=off skips the move)")
    require(e.max_grammar_compile_s > 0, f"engine.max_grammar_compile_s={e.max_grammar_compile_s} must be > 0 seconds")
    require(e.grammar_cache_size >= 1, f"engine.grammar_cache_size={e.grammar_cache_size} must be >= 1")
    require(
        e.tensor_parallel_size >= 1,
        f"engine.tensor_parallel_size={e.tensor_parallel_size} must be >= 1 (1: one device, no sharding)",
    )
    validate_distributed_config(e.distributed)
    validate_lora_config(cfg)
    require(1 <= srv.port <= 65535, f"server.port={srv.port} must be in 1..65535")
    require(
        srv.metrics_prefix in ("jaxcb", "vllm"),
        f"server.metrics_prefix={srv.metrics_prefix!r} must be jaxcb or vllm",
    )
    for name in ("max_queue_time_s", "request_timeout_s"):
        value = getattr(srv, name)
        require(value is None or value > 0, f"server.{name}={value} must be > 0 seconds, or null for none")
    require(srv.max_n >= 1, f"server.max_n={srv.max_n} must be >= 1")
    parsers = ("auto", "hermes", "llama3_json", "pythonic", "mistral")  # server/tool_parsers.TOOL_CALL_PARSERS
    require(srv.tool_call_parser in parsers,
            f"server.tool_call_parser={srv.tool_call_parser!r} must be one of {', '.join(parsers)}")
    reasoning_parsers = ("auto", "deepseek_r1", "qwen3")
    require(srv.reasoning_parser is None or srv.reasoning_parser in reasoning_parsers,
            f"server.reasoning_parser={srv.reasoning_parser!r} must be one of {', '.join(reasoning_parsers)}, "
            "or null for none")
    require(srv.responses_store_size >= 0,
            f"server.responses_store_size={srv.responses_store_size} must be >= 0 (0: store no responses)")
    require(srv.stream_buffer_tokens >= 1, f"server.stream_buffer_tokens={srv.stream_buffer_tokens} must be >= 1")
    require(srv.stream_stall_timeout_s > 0, f"server.stream_stall_timeout_s={srv.stream_stall_timeout_s} must be > 0")
    require(isinstance(srv.allowed_origins, (list, tuple)) and all(
        isinstance(o, str) and (o == "*" or re.fullmatch(r"https?://[a-z0-9.\-\[\]:]+", o) is not None)
        for o in srv.allowed_origins),
        f"server.allowed_origins={list(srv.allowed_origins)!r} must be a list of origins as browsers send them, "
        "such as [\"https://app.example.com\"] (scheme, lowercase host and port: no path or trailing slash), "
        "[\"*\"] for any, or []")
    require(srv.max_log_len is None or (not isinstance(srv.max_log_len, bool) and srv.max_log_len >= 0),
            f"server.max_log_len={srv.max_log_len} must be >= 0 (the characters of a prompt a log line shows), or null")
    require(srv.shutdown_timeout_s >= 0, f"server.shutdown_timeout_s={srv.shutdown_timeout_s} must be >= 0")
    require(
        srv.max_request_bytes >= 1024,
        f"server.max_request_bytes={srv.max_request_bytes} must be >= 1024",
    )
    validate_batch_and_tracing_config(srv)
    validate_replica_config(cfg)
    validate_speculative_config(cfg)
    validate_generate_config(cfg)
    require(
        (cfg.input is None) == (cfg.output is None),
        f"input={cfg.input} and output={cfg.output}: give both (a JSONL job) or neither",
    )
    b = cfg.bench
    require(
        b.task in ("offline", "policies", "async", "overhead", "flops"),
        f"bench.task={b.task!r} must be offline, policies, async, overhead or flops",
    )
    require(
        b.workload in ("lognormal", "random", "exp-output", "file"),
        f"bench.workload={b.workload!r} must be lognormal, random, exp-output or file",
    )
    require(b.workload != "file" or b.file is not None, "bench.workload=file needs bench.file=PATH")
    require(b.workload != "file" or os.path.isfile(b.file),
            f"bench.file={b.file} is not a file; give the path of a JSONL workload")
    for name in ("input_mean", "output_mean"):
        require(getattr(b, name) > 0, f"bench.{name}={getattr(b, name)} must be > 0 tokens")
    for name in ("input_sigma", "output_sigma"):
        require(getattr(b, name) >= 0, f"bench.{name}={getattr(b, name)} must be >= 0 (0: every length the mean)")
    require(b.url is None or (b.url.startswith(("http://", "https://")) and len(b.url.split("://", 1)[1]) > 0),
            f"bench.url={b.url!r} must be an http:// or https:// URL of the server to measure (e.g. "
            "http://127.0.0.1:8000), or null to start one in-process")
    require(b.output_cap >= 1, f"bench.output_cap={b.output_cap} must be >= 1")
    require(b.mode in ("offline", "serving"), f"bench.mode={b.mode!r} must be offline or serving")
    require(b.backend in ("engine", "http"), f"bench.backend={b.backend!r} must be engine or http")
    require(
        b.backend == "engine" or (b.mode == "serving" and b.task == "offline"),
        "bench.backend=http measures one server in serving mode: use it with bench.mode=serving and bench.task=offline",
    )
    require(b.request_rate is None or b.request_rate > 0, f"bench.request_rate={b.request_rate} must be > 0 or null")
    require(b.max_concurrency is None or b.max_concurrency >= 1, f"bench.max_concurrency={b.max_concurrency} must be >= 1")
    require(b.num_requests >= 1, f"bench.num_requests={b.num_requests} must be >= 1")
    require(b.scale > 0, f"bench.scale={b.scale} must be > 0")
    require(b.repeats >= 1, f"bench.repeats={b.repeats} must be >= 1")
    require(b.repeats == 1 or b.task in ("flops", "policies"),
             f"bench.repeats={b.repeats} repeats bench.task=flops or policies only; drop it for bench.task={b.task}")
    require(b.repeats == 1 or b.mode == "offline",
            f"bench.repeats={b.repeats} repeats offline runs only; drop it for bench.mode={b.mode}")
    require(len(cfg.generate.prompts) >= 1, "generate.prompts is empty; give at least one prompt")


def validate_generate_config(cfg: Config) -> None:
    """generate.*: the sampling fields scripts/generate.py builds its SamplingParams from, checked by it."""
    from jaxcb.errors import InvalidRequestError
    from jaxcb.sampling_params import SamplingParams

    g = cfg.generate
    try:
        SamplingParams(max_tokens=g.max_tokens, temperature=g.temperature, top_p=g.top_p, seed=g.seed)
    except InvalidRequestError as e:
        raise ConfigError(f"generate.{e}") from e


def validate_speculative_config(cfg: Config) -> None:
    """speculative.*: what jaxcb speculates with, and the combinations it refuses by name."""
    sp = cfg.speculative
    require(sp.method in ("none", "ngram", "draft"), f"speculative.method={sp.method!r} must be none, ngram or draft")
    require(sp.draft_model is None or sp.method == "draft",
            f"speculative.draft_model={sp.draft_model!r} is only read by speculative.method=draft; drop it or set "
            f"speculative.method=draft")
    if sp.method == "none":
        return
    require(sp.num_speculative_tokens >= 1,
            f"speculative.num_speculative_tokens={sp.num_speculative_tokens} must be >= 1 (or speculative.method=none)")
    require(1 <= sp.prompt_lookup_min <= sp.prompt_lookup_max,
            f"speculative.prompt_lookup_min={sp.prompt_lookup_min} and prompt_lookup_max={sp.prompt_lookup_max} "
            f"must satisfy 1 <= min <= max")
    d = sp.disable_by_batch_size
    require(d == "auto" or (isinstance(d, int) and d >= 1),
            f"speculative.disable_by_batch_size={d!r} must be a positive number of sequences, or auto")
    require(0 <= sp.min_mean_accepted <= sp.num_speculative_tokens,
            f"speculative.min_mean_accepted={sp.min_mean_accepted} must be in 0..speculative.num_speculative_tokens="
            f"{sp.num_speculative_tokens}: a verify step accepts at most that many, so more is never met and every "
            f"sequence backs off (0: never back off)")
    require(sp.acceptance_window >= 1, f"speculative.acceptance_window={sp.acceptance_window} must be >= 1")
    budget = cfg.scheduler.max_num_batched_tokens
    if budget != "auto":  # auto is checked at start-up, once resolved
        validate_speculative_budget(sp, budget, f"scheduler.max_num_batched_tokens={budget}")
    if sp.method == "draft":
        validate_draft_method(cfg)
    require(cfg.scheduler.policy != "static",
            f"speculative.method={sp.method} with scheduler.policy=static: the request-level baseline reserves every "
            "sequence's blocks up front and is measured without speculation; use policy fcfs or priority")


def validate_speculative_budget(sp: SpeculativeConfig, budget: int, source: str) -> None:
    """`budget`: the step's token budget, explicit or `auto` resolved (`source` names it)."""
    require(sp.method == "none" or budget > sp.num_speculative_tokens,
            f"speculative.num_speculative_tokens={sp.num_speculative_tokens} must be below {source}: a verify row "
            f"brings 1 + k tokens")


def validate_draft_method(cfg: Config) -> None:
    """speculative.method=draft: the draft model is a model config of its own, checked like `model`; what
    the draft runner does not do yet is refused by name."""
    sp = cfg.speculative
    require(sp.draft_model is not None,
            "speculative.method=draft needs speculative.draft_model: a model preset (e.g. tiny, smollm2) or "
            "{name: hf, checkpoint: DIR}, sharing the served model's tokenizer")
    draft = resolve_draft_model(sp.draft_model)
    validate_model_config(draft, "speculative.draft_model")
    require(cfg.engine.tensor_parallel_size == 1,
            f"speculative.method=draft with engine.tensor_parallel_size={cfg.engine.tensor_parallel_size}: the "
            f"draft model runs on one device; use tensor_parallel_size=1 or speculative.method=ngram")
    require(cfg.scheduler.preemption_mode != "swap",
            "speculative.method=draft with scheduler.preemption_mode=swap: swapping copies the served model's "
            "blocks only, not the draft's; use preemption_mode=recompute or speculative.method=ngram")
    require(cfg.cache.host_prefix_cache_gib == 0,
            f"speculative.method=draft with cache.host_prefix_cache_gib={cfg.cache.host_prefix_cache_gib:g}: the host "
            "tier keeps and restores the served model's blocks only, not the draft's; set cache.host_prefix_cache_gib=0 "
            "or use speculative.method=ngram")


def validate_distributed_config(d: DistributedConfig) -> None:
    given = {
        "coordinator_address": d.coordinator_address,
        "num_processes": d.num_processes,
        "process_id": d.process_id,
    }
    unset = [f"engine.distributed.{k}" for k, v in given.items() if v is None]
    require(
        len(unset) in (0, len(given)),
        f"{', '.join(unset)} unset: a multi-host run needs all of engine.distributed.coordinator_address, "
        f"num_processes and process_id (or none of them, for one host)",
    )
    if not unset:
        host, _, port = d.coordinator_address.rpartition(":")
        require(host.strip() != "" and port.isdigit() and 1 <= int(port) <= 65535,
                f"engine.distributed.coordinator_address={d.coordinator_address!r} must be HOST:PORT (process 0's "
                f"address and a port in 1..65535, e.g. 10.0.0.1:1234), the same on every host")
        require(d.num_processes >= 1, f"engine.distributed.num_processes={d.num_processes} must be >= 1")
        require(
            0 <= d.process_id < d.num_processes,
            f"engine.distributed.process_id={d.process_id} must be in 0..{d.num_processes - 1} "
            f"(engine.distributed.num_processes={d.num_processes})",
        )


def validate_replica_config(cfg: Config) -> None:
    """Backends and replica counts of jobs and the server, and the Ray cluster they run on."""
    for group, knobs in (("job", cfg.job), ("server", cfg.server)):
        require(knobs.backend in ("local", "ray"), f"{group}.backend={knobs.backend!r} must be local or ray")
        require(knobs.num_replicas >= 1, f"{group}.num_replicas={knobs.num_replicas} must be >= 1")
        require(
            knobs.backend == "ray" or knobs.num_replicas == 1,
            f"{group}.num_replicas={knobs.num_replicas} needs {group}.backend=ray (the local backend runs one engine)",
        )
    validate_routing_config(cfg)
    j, r = cfg.job, cfg.ray
    require(j.batch_size >= 1, f"job.batch_size={j.batch_size} must be >= 1")
    require(j.batches_per_replica >= 1, f"job.batches_per_replica={j.batches_per_replica} must be >= 1")
    require(j.max_batch_attempts >= 1, f"job.max_batch_attempts={j.max_batch_attempts} must be >= 1")
    require(r.num_cpus is None or r.num_cpus >= 1, f"ray.num_cpus={r.num_cpus} must be >= 1, or null for all CPUs")
    require(r.cpus_per_replica >= 0, f"ray.cpus_per_replica={r.cpus_per_replica} must be >= 0")
    require(r.gpus_per_replica >= 0, f"ray.gpus_per_replica={r.gpus_per_replica} must be >= 0")
    require(r.max_replica_restarts >= 0, f"ray.max_replica_restarts={r.max_replica_restarts} must be >= 0")
    require(r.replica_start_timeout_s > 0, f"ray.replica_start_timeout_s={r.replica_start_timeout_s} must be > 0")
    if r.address is None and r.num_cpus is not None:
        for group, knobs in (("job", cfg.job), ("server", cfg.server)):
            if knobs.backend == "ray":
                needed = knobs.num_replicas * r.cpus_per_replica
                require(
                    needed <= r.num_cpus,
                    f"{group}.num_replicas={knobs.num_replicas} x ray.cpus_per_replica={r.cpus_per_replica} needs "
                    f"{needed:g} CPUs but ray.num_cpus={r.num_cpus}; lower ray.cpus_per_replica (fractions are fine)",
                )


def validate_routing_config(cfg: Config) -> None:
    """server.routing and its knobs: how the Ray router picks a replica."""
    srv = cfg.server
    modes = ("least_loaded", "prefix_aware")  # = distributed/routing.py ROUTING_MODES (a test keeps them equal)
    require(srv.routing in modes, f"server.routing={srv.routing!r} must be one of {', '.join(modes)}")
    require(srv.routing_index_blocks is None or srv.routing_index_blocks >= 1,
            f"server.routing_index_blocks={srv.routing_index_blocks} must be >= 1, or null for the replica's "
            f"KV-cache blocks")
    require(srv.routing_max_imbalance >= 1.0,
            f"server.routing_max_imbalance={srv.routing_max_imbalance} must be >= 1 (a multiple of the least loaded "
            f"replica's waiting tokens)")
    require(srv.routing_imbalance_slack_tokens >= 0,
            f"server.routing_imbalance_slack_tokens={srv.routing_imbalance_slack_tokens} must be >= 0")
    defaults = type(srv)()  # ServerConfig's defaults: a knob moved from its default is one the user set
    for knob in ("routing_index_blocks", "routing_max_imbalance", "routing_imbalance_slack_tokens"):
        require(srv.routing == "prefix_aware" or getattr(srv, knob) == getattr(defaults, knob),
                f"server.{knob}={getattr(srv, knob)} is used only by server.routing=prefix_aware "
                f"(server.routing={srv.routing}): set server.routing=prefix_aware or drop it")
    if srv.routing == "prefix_aware":
        require(srv.backend == "ray",
                f"server.routing=prefix_aware routes among Ray replicas: it needs server.backend=ray "
                f"(server.backend={srv.backend} runs one engine)")
        require(cfg.cache.enable_prefix_caching,
                "server.routing=prefix_aware sends requests where their prefix is cached: it needs "
                "cache.enable_prefix_caching=true (or use server.routing=least_loaded)")


_ARCH_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "tie_word_embeddings",
)


def validate_model_config(m: ModelConfig, group: str = "model") -> None:
    """`group`: where the fields are set, named in each message: model, or speculative.draft_model (whose
    fields read as "speculative.draft_model's checkpoint")."""
    p = "model." if group == "model" else f"{group}'s "
    require(m.init in ("checkpoint", "random"), f"{p}init={m.init!r} must be 'checkpoint' or 'random'")
    require(m.dtype in DTYPES, f"{p}dtype={m.dtype!r} must be one of {list(DTYPES)}")
    require(
        m.layer_loop in LAYER_LOOPS,
        f"{p}layer_loop={m.layer_loop!r} must be one of {', '.join(LAYER_LOOPS)} "
        f"(auto: unrolled on CPU, scan elsewhere)",
    )
    require(
        m.linear_impl is None,
        f"{p}linear_impl={m.linear_impl} was renamed: use {p}backend={m.linear_impl} (auto, cpu or xla)",
    )
    require(
        m.backend in BACKENDS,
        f"{p}backend={m.backend!r} must be one of {', '.join(BACKENDS)} "
        f"(auto: the packed C++ matmul on CPU for float32 and bfloat16 weights, XLA's dot elsewhere)",
    )
    if m.init == "checkpoint":
        require(
            m.checkpoint is not None,
            f"{group}={m.name} has no weights: add {p}checkpoint=DIR (a Hugging Face or Orbax "
            f"checkpoint directory) or {p}init=random",
        )
    if m.checkpoint is not None:
        require(
            os.path.isdir(m.checkpoint) or (m.checkpoint.endswith(".gguf") and os.path.isfile(m.checkpoint)),
            f"{p}checkpoint={m.checkpoint} is not a directory or a .gguf file; give the path of a "
            f"Hugging Face (config.json + *.safetensors) or Orbax checkpoint directory, or of a GGUF file",
        )
    if m.tokenizer is not None:
        require(
            os.path.isfile(os.path.join(m.tokenizer, "tokenizer.json"))
            or (m.tokenizer.endswith(".gguf") and os.path.isfile(m.tokenizer)),
            f"{p}tokenizer={m.tokenizer} has no tokenizer.json; give a directory that has one, or a GGUF file",
        )
    if m.checkpoint is None:
        missing = [f for f in _ARCH_FIELDS if getattr(m, f) is None]
        require(
            not missing,
            f"{group}={m.name} with {p}init=random needs its architecture, but "
            f"{', '.join(p + f for f in missing)} are unset; use a preset with them "
            f"(model=tiny, llama3_1b, llama8b, llama70b) or add {p}checkpoint=DIR",
        )
    for f in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "max_position_embeddings"):
        v = getattr(m, f)
        require(v is None or v >= 1, f"{p}{f}={v} must be >= 1")
    require(m.head_dim is None or m.head_dim % 2 == 0,
            f"{p}head_dim={m.head_dim} must be even: RoPE rotates each head's dimensions in pairs")
    # One token id could only ever be sampled: the smallest vocabulary sampling draws from is two.
    require(m.vocab_size is None or m.vocab_size >= 2, f"{p}vocab_size={m.vocab_size} must be >= 2")
    # Null: the checkpoint's, else Llama's; 0 is what a checkpoint without one reads as (no cap, head_dim's
    # scale, the one rope), so it stays accepted; a negative value has no meaning.
    for f, zero in (("attn_logit_softcap", "no cap"), ("final_logit_softcap", "no cap"),
                    ("query_pre_attn_scalar", "head_dim's"), ("rope_local_theta", "the model's rope on every layer")):
        v = getattr(m, f)
        require(v is None or v >= 0, f"{p}{f}={v} must be >= 0 (0: {zero}), or null (the checkpoint's)")
    for f in ("rope_theta", "rms_norm_eps"):
        v = getattr(m, f)
        require(v is None or v > 0, f"{p}{f}={v} must be > 0, or null (the checkpoint's)")
    require(isinstance(m.generation_config, str) and (
        m.generation_config in ("auto", "none")
        or os.path.isfile(os.path.join(m.generation_config, "generation_config.json"))),
        f"{p}generation_config={m.generation_config!r} must be auto (the checkpoint's generation_config.json or "
        f"GGUF sampling keys), none (jaxcb's own defaults) or a directory holding a generation_config.json")
    negative = [t for t in m.eos_token_ids or () if t < 0]
    require(not negative, f"{p}eos_token_ids={list(m.eos_token_ids or ())} holds {negative}: token ids are >= 0, and a "
                          f"negative one is never drawn; drop it")
    require(m.bos_token_id is None,
            f"{p}bos_token_id={m.bos_token_id} is not read: the tokenizer's own BOS is used (tokenizer_config.json's "
            f"bos_token, and whether it adds one); drop {p}bos_token_id")
    if m.num_heads is not None and m.num_kv_heads is not None:
        require(
            m.num_heads % m.num_kv_heads == 0,
            f"{p}num_heads={m.num_heads} must be a multiple of {p}num_kv_heads={m.num_kv_heads}",
        )
    from jaxcb.model.families import FAMILIES, LAYER_TYPES, SLIDING_ATTENTION

    require(m.architecture is None or m.architecture in FAMILIES,
            f"{p}architecture={m.architecture!r} must be one of {', '.join(FAMILIES)}")
    require(m.hidden_act in (None, "silu", "gelu_tanh"), f"{p}hidden_act={m.hidden_act!r} must be silu or gelu_tanh")
    if m.architecture in FAMILIES and m.checkpoint is None:  # random weights: the fields build the layers, not the name
        family = FAMILIES[m.architecture]
        traits = {"qkv_bias": family.qkv_bias, "qk_norm": family.qk_norm, "embed_scale": family.gemma,
                  "norm_offset": family.gemma, "sandwich_norms": family.gemma,
                  "hidden_act": "gelu_tanh" if family.gemma else "silu"}
        unset_is = {"qkv_bias": False, "qk_norm": False, "embed_scale": False, "norm_offset": False,
                    "sandwich_norms": False, "hidden_act": "silu"}  # Llama's, where no checkpoint says otherwise
        differ = [f"{p}{f}={getattr(m, f)}" for f, want in traits.items()
                  if (unset_is[f] if getattr(m, f) is None else getattr(m, f)) != want]
        require(not differ, f"{p}architecture={m.architecture} but {', '.join(differ)}: with random weights the "
                            f"fields build the layers and the name only labels them; set the fields {m.architecture} "
                            f"has (as conf/model/ presets of it do), or drop {p}architecture")
    require(m.sliding_window is None or m.sliding_window >= 0,
            f"{p}sliding_window={m.sliding_window} must be >= 0 (0: no window)")
    if m.layer_types is not None:
        unknown = sorted(set(m.layer_types) - set(LAYER_TYPES))
        require(not unknown, f"{p}layer_types has {', '.join(map(repr, unknown))}; each must be one of "
                             f"{', '.join(LAYER_TYPES)}")
        require(m.num_layers is None or len(m.layer_types) == m.num_layers,
                f"{p}layer_types has {len(m.layer_types)} entries but {p}num_layers={m.num_layers}")
        require(m.sliding_window != 0 or SLIDING_ATTENTION not in m.layer_types,
                f"{p}layer_types has sliding_attention layers but {p}sliding_window=0 (no window): set the window's "
                f"tokens, or make every layer full_attention")
    if m.rope_scaling is not None:
        require(
            m.rope_scaling.rope_type in ("llama3", "yarn", "linear"),
            f"{p}rope_scaling.rope_type={m.rope_scaling.rope_type!r} is not supported; use 'llama3', 'yarn', "
            f"'linear' or set {p}rope_scaling=null",
        )
        validate_rope_scaling(m.rope_scaling, f"{p}rope_scaling")


def validate_rope_scaling(r: RopeScalingConfig, where: str) -> None:
    """The ranges the RoPE frequencies are computed in (model/llama.py: rope_inv_freq): a value outside them
    divides by zero or takes the log of a non-positive number, or gives frequencies of NaN."""
    require(r.factor > 0, f"{where}.factor={r.factor} must be > 0 (the context's stretch; 1: none)")
    if r.rope_type in ("llama3", "yarn"):
        require(r.original_max_position_embeddings >= 1,
                f"{where}.original_max_position_embeddings={r.original_max_position_embeddings} must be >= 1 (the "
                f"context the model was trained on)")
    if r.rope_type == "llama3":
        require(0 < r.low_freq_factor < r.high_freq_factor,
                f"{where}.low_freq_factor={r.low_freq_factor} and high_freq_factor={r.high_freq_factor} must satisfy "
                f"0 < low_freq_factor < high_freq_factor (Llama 3.1's: 1 and 4)")
    if r.rope_type == "yarn":
        require(0 < r.beta_slow <= r.beta_fast,
                f"{where}.beta_fast={r.beta_fast} and beta_slow={r.beta_slow} must satisfy 0 < beta_slow <= beta_fast "
                f"(rotations; YaRN's: 32 and 1)")
        require(r.attention_factor is None or r.attention_factor > 0,
                f"{where}.attention_factor={r.attention_factor} must be > 0, or null (0.1 ln(factor) + 1)")


def validate_lora_config(cfg: Config) -> None:
    """lora.*: ranges, and what LoRA cannot be served with (the adapters' own files are checked at start-up)."""
    lo = cfg.lora
    require(lo.adapters is None or isinstance(lo.adapters, dict),
            f"lora.adapters={lo.adapters!r} must be a mapping {{name: PEFT directory}}, e.g. lora.adapters={{sql: /ckpt/sql}}")
    require(lo.max_loras >= 1, f"lora.max_loras={lo.max_loras} must be >= 1")
    require(lo.max_rank >= 1, f"lora.max_rank={lo.max_rank} must be >= 1")
    require(lo.max_cpu_loras is None or lo.max_cpu_loras >= max(lo.max_loras, len(lo.start_up_adapters)),
            f"lora.max_cpu_loras={lo.max_cpu_loras} must be >= lora.max_loras={lo.max_loras} and >= the "
            f"{len(lo.start_up_adapters)} adapters of lora.adapters, or null")
    for name, path in lo.start_up_adapters.items():
        require(isinstance(name, str) and name.strip() == name and name != "" and "/" not in name,
                f"lora.adapters: the name {name!r} must be a non-empty word without '/' or surrounding spaces")
        require(isinstance(path, str) and path != "", f"lora.adapters.{name}={path!r} must be a PEFT directory")
    if not lo.enabled:
        require(not cfg.server.allow_runtime_lora,
                "server.allow_runtime_lora=true needs LoRA compiled in: set lora.enable=true (or lora.adapters)")
        return
    require(cfg.engine.tensor_parallel_size == 1,
            f"LoRA (lora.adapters / lora.enable) is not served with engine.tensor_parallel_size="
            f"{cfg.engine.tensor_parallel_size} yet: use engine.tensor_parallel_size=1, or serve without adapters")
    require(cfg.server.backend == "local",
            f"LoRA (lora.adapters / lora.enable) is not served with server.backend={cfg.server.backend!r} yet: "
            "use server.backend=local")
    require(cfg.speculative.method != "draft",
            "LoRA (lora.adapters / lora.enable) is not served with speculative.method=draft: the draft model has no "
            "adapters, so its proposals would be the base model's; use speculative.method=ngram or none")
