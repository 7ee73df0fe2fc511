"""Settings that the run's mode does not read, named at start-up.

A knob set for another mode (`speculative.num_speculative_tokens` with no speculation, `bench.request_rate`
in an offline benchmark) would otherwise be accepted without a word. They are warned about, not refused:
a Hydra sweep that varies the mode keeps the other knobs fixed, and a refusal would stop its runs.
"""

from __future__ import annotations

from typing import Any, Optional

from jaxcb.config import BenchConfig, CacheConfig, Config, JobConfig, LoraConfig, SchedulerConfig, SpeculativeConfig

_SPEC_FIELDS = ("num_speculative_tokens", "disable_by_batch_size", "min_mean_accepted", "acceptance_window")
_RAY_JOB_FIELDS = ("num_replicas", "batch_size", "batches_per_replica", "max_batch_attempts")
_SERVING_BENCH_FIELDS = ("backend", "url", "request_rate", "max_concurrency", "slo")


def _changed(node: Any, default: Any, names: tuple[str, ...]) -> list[tuple[str, Any]]:
    """The fields of `node` among `names` whose values differ from `default`'s."""
    return [(name, getattr(node, name)) for name in names if getattr(node, name) != getattr(default, name)]


def unused_settings(cfg: Config, script: Optional[str] = None) -> list[str]:
    """One sentence per setting changed from its default that this configuration's mode does not read.
    `script`: the entry point (serve, generate, bench); bench.* is checked only under bench, the one reader."""
    found: list[str] = []

    def note(group: str, changed: list[tuple[str, Any]], why: str) -> None:
        found.extend(f"{group}.{name}={value} is not used: {why}" for name, value in changed)

    sp, spec_default = cfg.speculative, SpeculativeConfig()
    if sp.method == "none":
        note("speculative", _changed(sp, spec_default, _SPEC_FIELDS + ("prompt_lookup_min", "prompt_lookup_max")),
             "speculative.method=none (set ngram or draft to speculate)")
    elif sp.method == "draft":
        note("speculative", _changed(sp, spec_default, ("prompt_lookup_min", "prompt_lookup_max")),
             "speculative.method=draft (ngram's lookup reads it)")
    s = cfg.scheduler
    if s.policy != "priority":
        note("scheduler", _changed(s, SchedulerConfig(), ("priority_aging_s",)), f"scheduler.policy={s.policy}")
    if s.preemption_mode != "swap":
        note("cache", _changed(cfg.cache, CacheConfig(), ("swap_space_gib",)),
             f"scheduler.preemption_mode={s.preemption_mode} (swap space is for preemption_mode=swap)")
    if cfg.attention.interpret and cfg.attention.impl in ("cpu", "xla", "reference"):
        note("attention", [("interpret", True)], f"attention.impl={cfg.attention.impl} (the Pallas kernel reads it)")
    if not cfg.lora.enabled:
        note("lora", _changed(cfg.lora, LoraConfig(), ("max_loras", "max_rank", "max_cpu_loras")),
             "no adapter is loaded and lora.enable=false")
    if not cfg.server.log_requests and cfg.server.max_log_len is not None:
        note("server", [("max_log_len", cfg.server.max_log_len)], "server.log_requests=false (set it to log requests)")
    job, job_default = cfg.job, JobConfig()
    if cfg.input is None:
        note("job", _changed(job, job_default, ("backend",) + _RAY_JOB_FIELDS), "no JSONL job (input= and output=)")
    elif job.backend != "ray":
        note("job", _changed(job, job_default, _RAY_JOB_FIELDS), f"job.backend={job.backend} (Ray replicas read it)")
    if script != "bench":
        return found
    b, bench_default = cfg.bench, BenchConfig()
    if b.mode == "offline":
        note("bench", _changed(b, bench_default, _SERVING_BENCH_FIELDS), "bench.mode=offline (serving mode reads it)")
    if b.workload != "exp-output":
        note("bench", _changed(b, bench_default, ("output_cap",)), f"bench.workload={b.workload}")
    if b.workload == "file":
        note("bench", _changed(b, bench_default, ("input_mean", "output_mean", "input_sigma", "output_sigma")),
             "bench.workload=file (the file gives the lengths)")
    return found
