"""`EngineStats`: the engine as one step left it, delivered with that step's outputs.

Metrics, the dashboard, the benchmarks and the Ray replicas' load reports read this snapshot and
never the engine's parts. Under async scheduling `Engine.step` returns the outputs of the step
dispatched the call before; its snapshot describes that same step (its tokens and bucket), not
the one now on the device. Plain data: no jax.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    # The step whose outputs come with this snapshot (all 0 when the call delivered no step's outputs).
    step_index: int  # its number: the engine's steps are numbered from 1 in dispatch order
    num_tokens: int  # real tokens it computed
    num_padded_tokens: int  # its token bucket
    num_prefill_tokens: int
    num_decode_tokens: int
    # The queue and the cache once those outputs were applied.
    num_running: int
    num_waiting: int
    num_swapped: int  # waiting sequences whose blocks are in host memory (scheduler.preemption_mode=swap)
    num_waiting_tokens: int  # prompt tokens of waiting sequences not yet computed
    kv_usage: float  # fraction of the device KV blocks in use
    host_kv_usage: float  # fraction of the host swap blocks in use (0 without swap)
    # Totals since start-up.
    num_steps: int  # steps dispatched
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, found
    num_recompiles: int
    # Requests aborted since the previous snapshot (they send no final output).
    aborted_request_ids: tuple[str, ...] = field(default=())
    # Speculative decoding, totals since start-up (all 0 with it off; jaxcb.core.speculation).
    spec_num_drafts: int = 0  # verify steps: a sequence bringing drafts to a step
    spec_num_draft_tokens: int = 0  # tokens proposed
    spec_num_accepted_tokens: int = 0  # of those, accepted
    spec_accepted_per_position: tuple[int, ...] = field(default=())  # [k]: accepted at each draft position
    spec_num_unspeculated_requests: int = 0  # requests that decoded without it (constraints, prompt_logprobs)
    # LoRA (all empty with it off): the adapters of running and waiting sequences, the slots, and per
    # adapter (name, requests added, tokens generated) since start-up.
    lora_running_adapters: tuple[str, ...] = ()
    lora_waiting_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    lora_totals: tuple[tuple[str, int, int], ...] = ()
    # The prefix cache's host tier, totals since start-up (all 0 with cache.host_prefix_cache_gib=0).
    host_prefix_cache_hits: int = 0  # tokens found in the host tier (a part of prefix_cache_hits)
    host_tier_bytes_to_host: int = 0  # evicted device blocks copied out
    host_tier_bytes_to_device: int = 0  # host hits copied back
    host_tier_evictions: int = 0  # host blocks whose contents were dropped for newer ones
    host_tier_usage: float = 0.0  # fraction of the host tier's blocks holding contents

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verify step yields on average: 1 + its accepted drafts (1.0 when none ran)."""
        return 1.0 + self.spec_num_accepted_tokens / max(1, self.spec_num_drafts)


EMPTY_STEP = dict(step_index=0, num_tokens=0, num_padded_tokens=0, num_prefill_tokens=0, num_decode_tokens=0)
