"""How much a running /v1/batches batch delays interactive requests: their time to first token (TTFT)
on an idle server, while a batch runs, and -- for contrast -- while the same load comes as ordinary
requests (which do not yield).

    python benchmarks/batch_ttft.py                           # the tiny model, about a minute on CPU
    python benchmarks/batch_ttft.py --probes 40 model=smollm2     # any Hydra overrides of the server's config

One server in this process, over real HTTP. A probe is a streamed completion of `--probe-tokens`
tokens; its TTFT is the time from sending it to its first chunk. `--probes` probes are sent one
after another, `--gap-s` apart, in each of three phases: idle; during a batch of `--batch-lines`
lines of `--batch-tokens` tokens each (greedy, ignore_eos); during the same lines sent as ordinary
requests, 2 x max_num_seqs at a time (as many as a batch keeps in flight). The line per phase gives
the median and 90th percentile TTFT; the ratios to idle are the figures docs/api.md states.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time

import httpx

DEFAULTS = ["model=tiny", "scheduler.max_num_seqs=8", "scheduler.max_num_batched_tokens=64",
            "engine.max_model_len=512", "server.admission_control=false"]


def ttft(url: str, model: str, prompt: str, max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():  # read to the end, so that the request ends as it would
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter() - start
    return first


def probe(url: str, a: argparse.Namespace) -> list[float]:
    times = []
    for i in range(a.probes):
        times.append(ttft(url, a.model, f"probe {i}: " + "word " * a.prompt_words, a.probe_tokens))
        time.sleep(a.gap_s)
    return times


def batch_lines(a: argparse.Namespace, model: str) -> list[dict]:
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model, "prompt": f"line {i}: " + "text " * a.prompt_words,
                      "max_tokens": a.batch_tokens, "temperature": 0, "ignore_eos": True}}
            for i in range(a.batch_lines)]


def during_batch(url: str, a: argparse.Namespace, model: str) -> tuple[list[float], dict]:
    content = "".join(json.dumps(line) + "\n" for line in batch_lines(a, model)).encode()
    upload = httpx.post(url + "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)},
                        timeout=60).json()
    batch = httpx.post(url + "/v1/batches", json={"input_file_id": upload["id"], "endpoint": "/v1/completions",
                                                  "completion_window": "24h"}, timeout=60).json()
    time.sleep(1.0)  # the batch fills the engine first
    times = probe(url, a)
    state = httpx.get(f"{url}/v1/batches/{batch['id']}", timeout=60).json()
    httpx.post(f"{url}/v1/batches/{batch['id']}/cancel", timeout=60)
    while httpx.get(f"{url}/v1/batches/{batch['id']}", timeout=60).json()["status"] != "cancelled":
        time.sleep(0.1)  # its lines in flight aborted: the next phase starts on an idle engine
    return times, state


def during_plain_load(url: str, a: argparse.Namespace, model: str, concurrency: int) -> tuple[list[float], int]:
    lines, stop, served = iter(batch_lines(a, model)), threading.Event(), []

    def client() -> None:
        for line in lines:
            if stop.is_set():
                return
            httpx.post(url + "/v1/completions", json=line["body"], timeout=600)
            served.append(1)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    times = probe(url, a)
    stop.set()
    for t in threads:
        t.join()
    return times, len(served)


def summary(name: str, times: list[float], idle: list[float]) -> str:
    p50, p90 = statistics.median(times), statistics.quantiles(times, n=10)[-1]
    ratio = p50 / statistics.median(idle)
    return f"{name:<28} TTFT median {p50 * 1e3:7.1f} ms  p90 {p90 * 1e3:7.1f} ms  median / idle {ratio:5.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--probe-tokens", type=int, default=8)
    parser.add_argument("--gap-s", type=float, default=0.2)
    parser.add_argument("--prompt-words", type=int, default=24)
    parser.add_argument("--batch-lines", type=int, default=400)
    parser.add_argument("--batch-tokens", type=int, default=128)
    a, overrides = parser.parse_known_args()
    a.model = None  # the served name, once the server is built

    from jaxcb.config import compose_config
    from jaxcb.server.app import build_app
    from jaxcb.server.run import serve_app_in_thread

    with tempfile.TemporaryDirectory() as batch_dir:
        cfg = compose_config(DEFAULTS + overrides + [f"server.batch_dir={batch_dir}"])
        app = build_app(cfg)
        state = app.state.jaxcb
        a.model = state.model_name
        with serve_app_in_thread(app) as url:
            probe(url, argparse.Namespace(**{**vars(a), "probes": 3}))  # warm-up: every step bucket compiled
            idle = probe(url, a)
            print(summary("idle", idle, idle))
            busy, batch = during_batch(url, a, state.model_name)
            print(summary("during a batch", busy, idle), f"  (batch {batch['status']}, {batch['request_counts']})")
            plain, served = during_plain_load(url, a, state.model_name, 2 * state.client.max_num_seqs)
            print(summary("during ordinary requests", plain, idle), f"  ({served} served meanwhile)")
            if batch["status"] != "in_progress":
                print("note: the batch ended before the probes did; raise --batch-lines", file=sys.stderr)


if __name__ == "__main__":
    main()
