"""The Prometheus series vLLM's published Grafana dashboard queries, with the labels its queries use.

Source: examples/online_serving/prometheus_grafana/grafana.json in github.com/vllm-project/vllm,
read at commit 004f771f3a6b49597546b05c7d83686d1e121fa0. Every query there filters on
model_name="$model_name", and the dashboard's model_name variable lists
label_values({__name__=~"vllm:.*"}, model_name): each series needs the label `model_name`.
Histogram quantiles group by `le`; the finish-reason panel groups by `finished_reason`.
"""

# (series as the dashboard's PromQL names it, labels the query filters or groups on)
DASHBOARD_SERIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # E2E Request Latency: quantiles and average
    ("vllm:e2e_request_latency_seconds_bucket", ("model_name", "le")),
    ("vllm:e2e_request_latency_seconds_sum", ("model_name",)),
    ("vllm:e2e_request_latency_seconds_count", ("model_name",)),
    # Token Throughput
    ("vllm:prompt_tokens_total", ("model_name",)),
    ("vllm:generation_tokens_total", ("model_name",)),
    # Time Per Output Token Latency: quantiles and mean
    ("vllm:time_per_output_token_seconds_bucket", ("model_name", "le")),
    ("vllm:time_per_output_token_seconds_sum", ("model_name",)),
    ("vllm:time_per_output_token_seconds_count", ("model_name",)),
    # Scheduler State
    ("vllm:num_requests_running", ("model_name",)),
    ("vllm:num_requests_waiting", ("model_name",)),
    # Time To First Token Latency: quantiles and average
    ("vllm:time_to_first_token_seconds_bucket", ("model_name", "le")),
    ("vllm:time_to_first_token_seconds_sum", ("model_name",)),
    ("vllm:time_to_first_token_seconds_count", ("model_name",)),
    # Cache Utilization
    ("vllm:gpu_cache_usage_perc", ("model_name",)),
    # Request Prompt Length and Request Generation Length heatmaps
    ("vllm:request_prompt_tokens_bucket", ("model_name", "le")),
    ("vllm:request_generation_tokens_bucket", ("model_name", "le")),
    # Finish Reason
    ("vllm:request_success_total", ("model_name", "finished_reason")),
    # Queue Time
    ("vllm:request_queue_time_seconds_sum", ("model_name",)),
    # Requests Prefill and Decode Time
    ("vllm:request_prefill_time_seconds_sum", ("model_name",)),
    ("vllm:request_decode_time_seconds_sum", ("model_name",)),
    # Max Generation Token in Sequence Group
    ("vllm:request_max_num_generation_tokens_sum", ("model_name",)),
)

# The same file at commit e88892c9080b29aa3dbc1d1096ba719ab0886163 (an earlier revision, from when
# vLLM could swap) also plots these two, in Scheduler State and Cache Utilization; they are checked
# too, so that a copy of that revision works as well.
SWAP_PANEL_SERIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vllm:num_requests_swapped", ("model_name",)),
    ("vllm:cpu_cache_usage_perc", ("model_name",)),
)
