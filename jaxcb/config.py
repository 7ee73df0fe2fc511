"""Typed configuration: one dataclass per Hydra config group, registered in the ConfigStore.

Hydra composes `conf/config.yaml`; because every group is backed by a dataclass, an unknown
key or a value of the wrong type fails at composition with Hydra's own message. What a
dataclass cannot express -- a value out of range, two fields that contradict each other --
is checked by `config_validation.validate_config`, which raises `ConfigError` with a sentence naming the
field(s) and what to change. Entry points call `load_config(cfg)` once and hand each
component only its own sub-config.

This module must not import jax: it is imported by the scheduler, which runs on the host.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from jaxcb.model.packaged import PackagedCheckpointError, is_packaged, resolve_packaged_checkpoint

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The 8-bit KV cache dtypes (jaxcb/kernels/attention/quantization.py): cache.dtype only, never model.dtype.
QUANTIZED_CACHE_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")
CACHE_DTYPES = (*DTYPES, *QUANTIZED_CACHE_DTYPES)
LAYER_LOOPS = ("auto", "scan", "unrolled")
BACKENDS = ("auto", "cpu", "xla")
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64)


class ConfigError(ValueError):
    """A configuration value that cannot work; the message says what to change."""


@dataclass
class RopeScalingConfig:
    """RoPE scaling, as HF's `rope_scaling`: llama3 (Llama 3.1's frequency-dependent scaling) or yarn
    (Qwen2.5/Qwen3's long-context configs)."""

    rope_type: str = "llama3"  # llama3 | yarn | linear (positions / factor: Gemma 3's full layers)
    factor: float = 8.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn: rotations past which a frequency is kept (extrapolated)
    beta_slow: float = 1.0  # yarn: rotations below which it is interpolated
    attention_factor: Optional[float] = None  # yarn: cos/sin scale; null: 0.1 ln(factor) + 1


@dataclass
class ModelConfig:
    """Which model to serve: a preset architecture plus where its weights come from.

    Architecture fields left as None are read from the checkpoint's config.json (preset `hf`).
    """

    name: str = "tiny"  # preset name; also the default served model name
    # HF directory (config.json + safetensors), Orbax directory, GGUF file, or package:MODULE/FILE
    # (a file inside an installed Python package, e.g. the smollm2 preset's)
    checkpoint: Optional[str] = None
    init: str = "checkpoint"  # "checkpoint": load weights from model.checkpoint; "random"
    seed: int = 0  # seed of random initialisation
    # parameter and activation dtype: float32 | bfloat16 | float16 | auto (float32 on CPU, where the
    # fast path is float32; elsewhere the checkpoint's dtype, float32 checkpoints as bfloat16)
    dtype: str = "bfloat16"
    tokenizer: Optional[str] = None  # directory with tokenizer.json; default: the checkpoint's
    # How the step runs the decoder layers: scan (over weights stacked by layer; one layer traced,
    # fast compiles) | unrolled (a loop over per-layer weight arrays; XLA:CPU copies every layer's
    # slice of a stacked weight, so this is faster there) | auto (unrolled on CPU, scan elsewhere).
    layer_loop: str = "auto"
    # The layer operations the model runs on (jaxcb/backends/): cpu (the packed C++ matmul over
    # weights packed once at load; float32, unrolled layers, one device) | xla (XLA's dot) |
    # auto (cpu where it applies, xla elsewhere).
    backend: str = "auto"
    linear_impl: Optional[str] = None  # renamed model.backend; refused when set
    vocab_size: Optional[int] = None
    hidden_size: Optional[int] = None
    intermediate_size: Optional[int] = None
    num_layers: Optional[int] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rms_norm_eps: Optional[float] = None
    rope_theta: Optional[float] = None
    # A mapping of RopeScalingConfig's fields, made a RopeScalingConfig by load_config. Not typed as one:
    # OmegaConf cannot merge a mapping into a structured node that is null, and on most presets it is,
    # so `model.rope_scaling={rope_type: yarn, factor: 4.0}` (Qwen's long-context setting) would fail.
    rope_scaling: Optional[Any] = None
    max_position_embeddings: Optional[int] = None
    tie_word_embeddings: Optional[bool] = None
    # The family's differences from Llama (jaxcb/model/families.py); unset: read from the checkpoint,
    # else Llama's (no bias, no q/k norm, no window).
    architecture: Optional[str] = None  # llama | mistral | qwen2 | qwen3 | gemma2 | gemma3_text
    qkv_bias: Optional[bool] = None  # a bias on the q, k and v projections (qwen2)
    qk_norm: Optional[bool] = None  # RMSNorm over each head's q and k before RoPE (qwen3)
    sliding_window: Optional[int] = None  # tokens a query sees, its own included, on windowed layers; 0: none
    layer_types: Optional[list[str]] = None  # per layer: full_attention | sliding_attention; unset: all windowed
    embed_scale: Optional[bool] = None  # embeddings times sqrt(hidden_size) (gemma)
    norm_offset: Optional[bool] = None  # RMSNorm scales by (1 + w) in float32 (gemma)
    hidden_act: Optional[str] = None  # silu (SwiGLU) | gelu_tanh (GeGLU, gemma)
    sandwich_norms: Optional[bool] = None  # norms after attention and after the MLP too (gemma)
    attn_logit_softcap: Optional[float] = None  # attention scores -> c tanh(scores / c); 0: none (gemma2: 50)
    final_logit_softcap: Optional[float] = None  # logits -> c tanh(logits / c); 0: none (gemma2: 30)
    query_pre_attn_scalar: Optional[float] = None  # scores scaled by its -1/2 power; 0: head_dim's (gemma: 256)
    rope_local_theta: Optional[float] = None  # RoPE base of the windowed layers; 0: the model's rope (gemma3: 10000)
    bos_token_id: Optional[int] = None  # refused when set: the tokenizer's own BOS is used
    eos_token_ids: Optional[list[int]] = None  # end-of-sequence ids besides the tokenizer's and the checkpoint's
    # Defaults for the sampling fields a request leaves out (jaxcb/sampling_defaults.py): auto (the checkpoint's
    # generation_config.json, or a GGUF's general.sampling keys) | none (jaxcb's own: OpenAI's) | DIR (its
    # generation_config.json)
    generation_config: str = "auto"


@dataclass
class CacheConfig:
    """The paged KV cache: fixed-size blocks in buffers allocated once at start-up."""

    block_size: int = 16  # tokens per KV block: 8, 16, 32 or 64
    num_blocks: Optional[int] = None  # total blocks incl. the null block; None: from the memory below
    memory_fraction: float = 0.9  # GPU/TPU: share of device memory for weights + cache when num_blocks is None
    cpu_kv_cache_gib: float = 4.0  # CPU: GiB of host memory for the cache when num_blocks is None
    dtype: str = "auto"  # auto (bf16 on GPU/TPU, f32 on CPU) | float32 | bfloat16 | float16 | int8 | fp8_e4m3 | fp8_e5m2
    # 8-bit caches without k_scale/v_scale in the checkpoint: tokens of the shipped calibration text
    # (jaxcb/data/kv_calibration.txt) prefilled once at start-up to measure each (layer, KV head)'s range.
    kv_calibration_tokens: int = 512
    enable_prefix_caching: bool = True  # reuse the K/V of full blocks whose tokens (and all before) match
    swap_space_gib: float = 4.0  # host memory for blocks of sequences preempted by swap
    host_prefix_cache_gib: float = 0.0  # host memory for prefix-cache blocks the device evicts (0: off)
    block_growth: Optional[int] = None  # blocks a decoding sequence takes at once; None: 4 with the CPU attention kernel, else 1


@dataclass
class AttentionConfig:
    """Which implementation of attention over the paged cache the model uses."""

    impl: str = "auto"  # auto (pallas on GPU, the C++ kernel on CPU) | pallas | cpu | xla | reference
    interpret: bool = False  # run the Pallas kernel in the interpreter (CPU tests; slow)


@dataclass
class SchedulerConfig:
    """Iteration-level scheduling limits (used by the continuous-batching engine)."""

    # Sequences in one step, and the token budget of one step (prefill chunks + decodes); auto: sized
    # from the device and the model at start-up (jaxcb.batch_limits: 64 and 512 on CPU).
    max_num_seqs: Union[int, str] = "auto"
    max_num_batched_tokens: Union[int, str] = "auto"
    policy: str = "fcfs"  # fcfs | priority | static (request-level batching baseline)
    preemption_mode: str = "recompute"  # recompute | swap (to cache.swap_space_gib of host memory; recompute if full)
    priority_aging_s: float = 10.0  # priority: a waiting request gains one priority level per this many seconds
    max_waiting_requests: Optional[int] = None  # admission control: more waiting requests are refused (429)
    max_waiting_tokens: Optional[int] = None  # admission control: prompt tokens waiting, at most
    enable_chunked_prefill: bool = True  # false: each prompt's prefill runs whole, in one step
    long_prefill_token_threshold: Optional[int] = None  # most tokens one prefill takes per step; None: the budget
    max_num_partial_prefills: int = 1  # prompts that may be mid-prefill at once


@dataclass
class SpeculativeConfig:
    """Speculative decoding (jaxcb/core/speculation.py): proposals verified in the ordinary step."""

    method: str = "none"  # none | ngram (prompt lookup: what followed the last n tokens earlier on)
    num_speculative_tokens: int = 4  # k: most proposed tokens a sequence verifies in one step
    prompt_lookup_min: int = 2  # ngram: the shortest suffix matched against the sequence's earlier tokens
    prompt_lookup_max: int = 4  # ngram: the longest (tried first)
    # A sequence speculates only while at most this many sequences decode (a larger batch is compute-bound:
    # verifying k tokens costs about k decodes); auto: on CPU 32 for ngram (measured) and 8 for
    # draft, 64 on an accelerator.
    disable_by_batch_size: Union[int, str] = "auto"
    # Back-off: a sequence whose last `acceptance_window` verify steps accepted fewer than this many of its
    # proposed tokens on average stops proposing for 16 tokens, then 32, 64, ... while it keeps failing.
    min_mean_accepted: float = 0.5
    acceptance_window: int = 4
    # method=draft: the model that proposes, in the forms `model` takes: a preset name (tiny, smollm2, ...)
    # or a mapping of model fields ({name: hf, checkpoint: DIR} or a preset with overrides, e.g.
    # {name: tiny, seed: 1}); it must share the served model's tokenizer (`resolve_draft_model`).
    draft_model: Optional[Any] = None


@dataclass
class LoraConfig:
    """Multi-LoRA serving (jaxcb/lora/): PEFT adapters over the one base model, any mix per step."""

    # Start-up adapters, {name: PEFT directory}; a request's `model` names one of them or the base.
    # (Optional so that `lora.adapters={a: /path}` on the command line replaces it rather than merging
    # into a struct node, which Hydra refuses.)
    adapters: Any = None  # {name: path}
    enable: bool = False  # compile LoRA in even with no start-up adapter (for run-time loading); on when adapters is not empty
    max_loras: int = 4  # device slots: adapters a single step can mix (more wait for a slot, least recently used swapped out)
    max_rank: int = 16  # largest rank an adapter may have (slots are this wide; a smaller rank is zero-padded)
    max_cpu_loras: Optional[int] = None  # adapters whose weights stay in host memory (LRU; others read again when named); None: max(max_loras, start-up adapters)

    @property
    def enabled(self) -> bool:
        return self.enable or bool(self.adapters)

    @property
    def start_up_adapters(self) -> dict[str, str]:
        return dict(self.adapters or {})


@dataclass
class DistributedConfig:
    """Multi-host JAX: `jax.distributed.initialize` arguments; all null (one host) skips it."""

    coordinator_address: Optional[str] = None  # "host:port" of process 0, the same on every host
    num_processes: Optional[int] = None  # hosts (processes) taking part
    process_id: Optional[int] = None  # this host's rank, 0 .. num_processes - 1


@dataclass
class EngineConfig:
    """How the engine runs steps on the device(s)."""

    max_model_len: Optional[int] = None  # prompt + output limit; None: the model's max positions
    async_scheduling: bool = True  # schedule step N+1 on the host while the device runs step N
    seed: int = 0  # base seed of sampling
    compilation_cache_dir: Optional[str] = None  # JAX persistent compilation cache; None: ~/.cache/jaxcb/xla
    token_buckets: Optional[list[int]] = None  # step sizes in tokens; None: runner.default_token_buckets
    seq_buckets: Optional[list[int]] = None  # step sizes in sequences; None: min(token bucket, max_num_seqs)
    context_buckets: Optional[list[int]] = None  # block-table widths; None: 16 blocks and all (xla), all (pallas)
    max_logprobs: int = 20  # most top logprobs a request may ask for (OpenAI: top_logprobs <= 20); computed only in steps that ask
    max_stop_token_ids: int = 8  # most EOS + stop token ids suppressed per row under min_tokens
    # Threads compiling the step buckets at start-up; auto: the host's cores, at most 8.
    compile_workers: Union[int, str] = "auto"
    # When the rarely used step variants (random, masked, prompt-logprobs) compile: startup (all
    # before serving), background (after start-up, on a thread of their own), first_use (when a
    # request first needs one; only it waits); auto: background with 8 cores or more, else first_use.
    compile_rare_variants: str = "auto"
    # Sampling levels compiled for every bucket (jaxcb.sampling): greedy (argmax only), random
    # (temperature, min_tokens), full (penalties, top-k/top-p/min-p, logprobs); a step runs the least
    # compiled one that serves all its rows. full must be there: it serves every request.
    sampling_variants: list[str] = dataclasses.field(default_factory=lambda: ["greedy", "random", "full"])
    # Token masks and logit_bias (structured outputs, tool_choice, allowed_token_ids, bad_words): one more
    # compiled variant of every bucket, used only by steps with such a row; false refuses those fields.
    masked_sampling: bool = True
    # prompt_logprobs (and echo with logprobs): a third variant of every bucket, computing each prompt
    # row's logprobs 128 rows at a time; used only by steps that prefill such a request; false refuses them.
    prompt_logprobs: bool = True
    max_logit_bias: int = 300  # most logit_bias entries per request (OpenAI's limit)
    max_grammar_compile_s: float = 10.0  # a schema or grammar that compiles for longer is refused (400)
    grammar_cache_size: int = 128  # compiled grammars kept (by schema text), least recently used dropped
    tensor_parallel_size: int = 1  # devices each weight and the KV cache are split over (by head / MLP column)
    # On a CPU host: the prepared weights moved onto 2 MiB pages (madvise MADV_COLLAPSE, Linux 6.1+)
    # after start-up prepares them, so that the matmul streams them with fewer TLB misses; off: left as allocated.
    huge_pages: str = "auto"
    huge_pages_seconds: float = 5.0  # start-up time the move onto 2 MiB pages may take; the rest stays on 4 KiB pages
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # multi-host; null: one host


@dataclass
class ServerConfig:
    """The OpenAI-compatible HTTP server."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: Optional[str] = None  # None: the preset name, or the checkpoint folder for `hf`
    # Refuse (429 + Retry-After) past 8 x scheduler.max_num_seqs waiting requests or twice the KV
    # cache's tokens waiting, where scheduler.max_waiting_requests / max_waiting_tokens set no limit;
    # the server only (LLM.generate and jobs queue without bound).
    admission_control: bool = True
    # Deadlines (seconds; null: none). A request with nothing generated max_queue_time_s after it
    # arrived is refused (503 + Retry-After); one running request_timeout_s ends with what it has
    # (finish_reason "timeout"). A request's own `timeout` field may ask for less, never more.
    max_queue_time_s: Optional[float] = None
    request_timeout_s: Optional[float] = None
    # Prefix of the Prometheus series at /metrics: jaxcb (jaxcb:*) | vllm (vllm:*, so that dashboards
    # written for vLLM, such as the Grafana one in vLLM's repository, work unchanged).
    metrics_prefix: str = "jaxcb"
    # A Jinja chat template (a file's path, or the template itself) in place of the checkpoint's;
    # it also lets chat requests reach a checkpoint that has none. Used by the server and by jobs.
    chat_template: Optional[str] = None
    api_key: Optional[str] = None  # when set, /v1/* requires "Authorization: Bearer <key>"
    max_request_bytes: int = 1 << 20
    max_n: int = 16  # most completions per request
    # How tool calls are read from the model's text: auto (from the chat template) | hermes | llama3_json | pythonic.
    tool_call_parser: str = "auto"
    # Tools for chat templates that do not render them: written into the conversation in the parser's
    # syntax (server/tool_prompt.py); false: a request whose tools the template would drop is refused.
    tool_prompt_fallback: bool = True
    # How reasoning is read out of replies (server/reasoning.py): auto (from the chat template: qwen3 or
    # deepseek_r1 when it writes <think>, else none) | deepseek_r1 | qwen3 | None (replies are all content).
    reasoning_parser: Optional[str] = "auto"
    # Structured outputs and forced tool calls hold the whole reply, reasoning included (vLLM's
    # enable_in_reasoning); false: only the answer after </think>.
    structured_outputs_in_reasoning: bool = False
    # /v1/responses kept in memory for previous_response_id (least recently stored dropped first).
    responses_store_size: int = 256
    # /v1/files and /v1/batches: uploaded files, batches and their results live here (relative: to the
    # directory the server starts in); a server restarted on the same folder resumes its unfinished batches.
    batch_dir: str = "outputs/batches"
    max_file_bytes: int = 200 << 20  # largest file POST /v1/files takes (OpenAI's batch input limit: 200 MB)
    # OpenTelemetry: one span per request, exported over OTLP/HTTP to this URL (e.g.
    # http://collector:4318/v1/traces); None: no tracing (nothing of OpenTelemetry is imported).
    otlp_endpoint: Optional[str] = None
    stream_buffer_tokens: int = 1024  # generated tokens that may wait for one streaming reader before it is aborted
    stream_stall_timeout_s: float = 30.0  # a streaming reader that reads nothing for this long is aborted
    shutdown_timeout_s: float = 10.0  # on SIGTERM: time in-flight requests get to finish before they are aborted
    # The engine loop dead (with ray: no replica back within ray.replica_start_timeout_s): stop serving and exit 1,
    # as vLLM's server exits when its engine dies, so that a supervisor restarts it; false: stay up, /health and
    # every request answering 503.
    exit_on_engine_death: bool = True
    backend: str = "local"  # local: one engine in this process | ray: num_replicas engines on Ray behind this endpoint
    num_replicas: int = 1  # ray: engine replicas; server.routing says which one takes each request
    # ray: how the router picks a replica (distributed/routing.py): least_loaded (the fewest waiting
    # tokens) | prefix_aware (the one whose recent prompts share the longest prefix of blocks with the
    # request, unless its waiting tokens exceed routing_max_imbalance x the least loaded replica's
    # + routing_imbalance_slack_tokens; then the least loaded). prefix_aware needs cache.enable_prefix_caching.
    routing: str = "least_loaded"
    # prefix_aware: block hashes remembered per replica, least recently used dropped; None: its KV-cache blocks
    routing_index_blocks: Optional[int] = None
    routing_max_imbalance: float = 2.0  # prefix_aware: see routing
    routing_imbalance_slack_tokens: int = 2048  # prefix_aware: see routing (lets an idle cluster follow prefixes)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind api_key); false: both are 404s.
    allow_runtime_lora: bool = False
    # Cross-origin requests from browsers (CORS): the origins whose pages may call the API ("*": any, vLLM's
    # default); [] (jaxcb's default): none, only same-origin pages such as /dashboard, so that a web page the
    # user opens cannot read a local server's answers. Credentials (cookies) are never allowed.
    allowed_origins: list[str] = field(default_factory=list)
    # One INFO line per completions / chat / responses request (HTTP or batch line) as it arrives: its id,
    # endpoint, model, prompt and sampling parameters (vLLM's --enable-log-requests); off: prompts stay out of logs.
    log_requests: bool = False
    max_log_len: Optional[int] = None  # log_requests: a prompt's characters shown (the rest counted); None: all


@dataclass
class JobConfig:
    """How scripts/generate.py runs a JSONL job (input=, output=): one engine here, or replicas on Ray."""

    backend: str = "local"  # local: one engine in this process | ray: num_replicas engines on Ray (jaxcb[dist])
    num_replicas: int = 1  # ray: engine replicas, each a Ray actor with its own model and KV cache
    batch_size: int = 32  # ray: records handed to a replica at once; a batch lost with its replica is retried whole
    batches_per_replica: int = 2  # ray: batches queued on each replica, so it never idles waiting for the driver
    max_batch_attempts: int = 3  # ray: a batch lost with its replica this many times stops the job (a rerun resumes)


@dataclass
class RayConfig:
    """The Ray cluster that job.backend=ray and server.backend=ray place their engine replicas on."""

    address: Optional[str] = None  # null: start a local cluster in this process; "auto" or "ray://host:10001": join one
    num_cpus: Optional[int] = None  # the local cluster's CPUs (null: all of this machine's); ignored when joining one
    cpus_per_replica: float = 1.0  # Ray CPUs each replica reserves; fractions let several replicas share a small machine
    gpus_per_replica: float = 0.0  # Ray GPUs each replica reserves: 1 on a GPU cluster gives each engine its own GPU
    max_replica_restarts: int = 3  # a replica that dies is started again (its model reloaded) at most this many times
    replica_start_timeout_s: float = 600.0  # replicas not ready by then (no room on the cluster?) stop the start-up


@dataclass
class GenerateConfig:
    """Options of scripts/generate.py (offline generation of `prompts`)."""

    prompts: list[str] = field(default_factory=lambda: ["The quick brown fox", "Once upon a time"])
    max_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: Optional[int] = None


@dataclass
class SLOConfig:
    ttft_ms: float = 1000.0  # a request meets the SLO if its time to first token is at most this
    tpot_ms: float = 100.0  # ... and its mean time per output token after the first at most this


@dataclass
class BenchConfig:
    """Options of scripts/bench.py."""

    mode: str = "offline"  # offline (all requests at once) | serving (arrivals at request_rate, TTFT/TPOT/ITL/E2E)
    backend: str = "engine"  # serving: engine (stepped in-process) | http (streaming OpenAI calls to a real server)
    url: Optional[str] = None  # backend=http: the server, e.g. http://127.0.0.1:8000; null: start one in-process
    request_rate: Optional[float] = None  # serving: Poisson arrivals per second; null: all at once
    max_concurrency: Optional[int] = None  # serving: requests in the engine at most (the rest wait client-side)
    slo: SLOConfig = field(default_factory=SLOConfig)
    task: str = "offline"  # offline | policies (fcfs vs static) | async (on vs off) | overhead (engine vs replayed steps) | flops (model FLOP/s vs the matmul ceiling)
    workload: str = "lognormal"  # lognormal (ShareGPT-like) | random (fixed lengths) | exp-output | file
    output_cap: int = 128  # exp-output: outputs are exponential, capped here (32 / 128 / 512 / 1536)
    file: Optional[str] = None  # workload=file: JSONL of {"prompt_token_ids" | "prompt", "output_len"}
    num_requests: int = 200
    input_mean: float = 200.0  # tokens, before scale
    output_mean: float = 300.0
    input_sigma: float = 1.0  # lognormal sigma of the input lengths
    output_sigma: float = 0.8
    scale: float = 0.25  # shrinks every length, for small machines
    seed: int = 0
    repeats: int = 1  # task=flops: runs between ceiling readings; task=policies: fcfs/static pairs, order swapped each pair; fresh prompts, median reported


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    job: JobConfig = field(default_factory=JobConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    input: Optional[str] = None  # scripts/generate.py: a JSONL job to run instead of generate.prompts
    output: Optional[str] = None  # scripts/generate.py: where the job's results go (appended; resumable)


def register_configs() -> None:
    """Register the schema of the whole tree and of each group (presets extend `base_<group>`)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, node in (
        ("model", ModelConfig),
        ("cache", CacheConfig),
        ("attention", AttentionConfig),
        ("scheduler", SchedulerConfig),
        ("engine", EngineConfig),
        ("server", ServerConfig),
        ("job", JobConfig),
        ("speculative", SpeculativeConfig),
        ("lora", LoraConfig),
        ("ray", RayConfig),
    ):
        cs.store(group=group, name=f"base_{group}", node=node)


register_configs()

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def load_config(cfg: DictConfig | Config) -> Config:
    """Turn Hydra's DictConfig into real dataclasses and check it; raise ConfigError if it cannot work."""
    if isinstance(cfg, DictConfig):
        unknown = _unknown_keys(cfg)
        if unknown:  # Hydra's `+key=value` adds keys the schema lacks; to_object would drop them silently
            from jaxcb.config_errors import unknown_field

            raise ConfigError("; ".join(unknown_field(path, kind) for path, kind in unknown))
        obj: Any = OmegaConf.to_object(cfg)
    else:
        obj = cfg
    if not isinstance(obj, Config):
        raise ConfigError(f"expected a jaxcb Config, got {type(obj).__name__}")
    obj.model.rope_scaling = rope_scaling_config(obj.model.rope_scaling, "model.rope_scaling")
    if is_packaged(obj.model.checkpoint):  # a location, like a relative path: resolved once, here
        try:
            obj.model.checkpoint = resolve_packaged_checkpoint(obj.model.checkpoint)
        except PackagedCheckpointError as e:
            raise ConfigError(str(e)) from e
    from jaxcb.config_validation import validate_config  # the checks import these dataclasses

    validate_config(obj)
    return obj


def _unknown_keys(node: DictConfig, path: str = "") -> list[tuple[str, type]]:
    """Keys of `node` (and the config groups under it) that its dataclass does not have, each with
    that dataclass."""
    kind = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(kind):
        return []  # a free mapping (lora.adapters, model.rope_scaling, ...)
    fields = {f.name for f in dataclasses.fields(kind)}
    unknown = []
    for key in node.keys():
        if key not in fields:
            unknown.append((f"{path}{key}", kind))
            continue
        child = node._get_node(key)  # not resolved: an interpolation stays as written
        if isinstance(child, DictConfig):
            unknown += _unknown_keys(child, f"{path}{key}.")
    return unknown


def presets(group: str) -> list[str]:
    """The presets of a config group: conf/<group>/*.yaml."""
    folder = os.path.join(CONF_DIR, group)
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml")) if os.path.isdir(folder) else []


def rope_scaling_config(value: Any, where: str) -> Optional[RopeScalingConfig]:
    """`model.rope_scaling` as a RopeScalingConfig (None: no scaling); raise ConfigError naming an unknown
    field or a value of the wrong type."""
    if value is None or isinstance(value, RopeScalingConfig):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{where}={value!r} must be null or a mapping of its fields, e.g. "
                          f"{where}={{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}}")
    known = {f.name: f for f in dataclasses.fields(RopeScalingConfig)}
    unknown = [key for key in value if key not in known]
    if unknown:
        raise ConfigError(f"{where} has no field {', '.join(map(str, unknown))}; its fields are {', '.join(known)}")
    try:
        node = OmegaConf.merge(OmegaConf.structured(RopeScalingConfig), value)
    except Exception as e:  # omegaconf says which type it wanted
        raise ConfigError(f"{where}.{getattr(e, 'full_key', '')}: {str(e).splitlines()[0]}") from e
    return OmegaConf.to_object(node)


def resolve_draft_model(value: Any) -> ModelConfig:
    """`speculative.draft_model` as a ModelConfig: a preset name, or a mapping of model fields whose
    `name` is a preset (conf/model/<name>.yaml) that the other fields override. Raise ConfigError
    naming what is wrong (an unknown preset, an unknown field, a wrong type)."""
    if isinstance(value, (DictConfig, dict)):
        fields = OmegaConf.to_container(value) if isinstance(value, DictConfig) else dict(value)
    elif isinstance(value, str):
        fields = {"name": value}
    else:
        raise ConfigError(f"speculative.draft_model={value!r} must be a model preset name or a mapping of "
                          f"model fields (name: a preset)")
    name = fields.get("name")
    preset = os.path.join(CONF_DIR, "model", f"{name}.yaml")
    if not isinstance(name, str) or not os.path.isfile(preset):
        raise ConfigError(f"speculative.draft_model's name={name!r} must be one of the model presets: "
                          f"{', '.join(presets('model'))}")
    base = OmegaConf.load(preset)
    base.pop("defaults", None)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), base, fields)
        draft: ModelConfig = OmegaConf.to_object(merged)
    except Exception as e:  # omegaconf's own errors name the key and the type
        raise ConfigError(f"speculative.draft_model={fields!r}: {e}") from e
    draft.rope_scaling = rope_scaling_config(draft.rope_scaling, "speculative.draft_model's rope_scaling")
    for name in ("checkpoint", "tokenizer"):  # package:MODULE/FILE, resolved as model.checkpoint is
        if is_packaged(getattr(draft, name)):
            try:
                setattr(draft, name, resolve_packaged_checkpoint(getattr(draft, name)))
            except PackagedCheckpointError as e:
                raise ConfigError(f"speculative.draft_model's {name}: {e}") from e
    return draft


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The checked Config that `scripts/*.py <overrides>` would see, for use from Python."""
    from jaxcb.config_errors import compose_overrides

    return load_config(compose_overrides(overrides))


def asdict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)
