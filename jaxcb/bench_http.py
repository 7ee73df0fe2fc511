"""The serving benchmark over HTTP: streaming OpenAI completions against a running server.

The same workload and figures as the in-process serving benchmark, but measured as a
client sees them over the wire: each request is a streaming `/v1/completions` call with the
prompt as token ids, `ignore_eos` and greedy sampling; TTFT is the time to the first chunk
with text, ITL the gaps between chunks (spread over the tokens a chunk carries), and the
output token count comes from the final `usage` chunk. Poisson arrivals at
`bench.request_rate` (all at once if null); `bench.max_concurrency` bounds requests in flight.

`bench.url` names the server; left null, `serve_in_thread` starts one in this process on a
free loopback port with the same config, so one command measures the whole HTTP path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import httpx
import numpy as np

from jaxcb.benchmark import WorkItem, percentiles
from jaxcb.config import BenchConfig, Config


@dataclass
class RequestTiming:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival time of each chunk with text
    output_tokens: int = 0
    error: Optional[str] = None


async def _one_request(client: httpx.AsyncClient, url: str, model: str, item: WorkItem, t: RequestTiming) -> None:
    body = {
        "model": model, "prompt": item.prompt_token_ids, "max_tokens": item.output_len, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                t.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    t.error = chunk["error"].get("message", "error event")
                    return
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    t.chunks.append(time.perf_counter())
                if chunk.get("usage"):
                    t.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        t.error = f"{type(e).__name__}: {e}"


async def _run(url: str, model: str, items: list[WorkItem], b: BenchConfig) -> tuple[list[RequestTiming], float]:
    rng = np.random.default_rng(b.seed + 1)
    gaps = rng.exponential(1.0 / b.request_rate, len(items)) if b.request_rate else np.zeros(len(items))
    arrivals = np.cumsum(gaps)
    limit = asyncio.Semaphore(b.max_concurrency or len(items))
    timings: list[RequestTiming] = []
    limits = httpx.Limits(max_connections=b.max_concurrency or len(items), max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        start = time.perf_counter()

        async def send(i: int, item: WorkItem) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            async with limit:
                # TTFT counts from the scheduled arrival, as for a real user (queueing at the
                # client's concurrency limit included).
                t = RequestTiming(sent=start + arrivals[i])
                timings.append(t)
                await _one_request(client, url, model, item, t)

        await asyncio.gather(*(send(i, w) for i, w in enumerate(items)))
        return timings, time.perf_counter() - start


def served_model(url: str) -> str:
    r = httpx.get(url + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def run_serving_http(url: str, items: list[WorkItem], b: BenchConfig) -> dict:
    timings, seconds = asyncio.run(_run(url, served_model(url), items, b))
    ok = [t for t in timings if t.error is None and t.chunks]
    ttft = [t.chunks[0] - t.sent for t in ok]
    tpot = [(t.chunks[-1] - t.chunks[0]) / (t.output_tokens - 1) if t.output_tokens > 1 else 0.0 for t in ok]
    itl: list[float] = []
    for t in ok:  # a chunk may carry several tokens: spread its gap over them
        per_chunk = max(1.0, (t.output_tokens - 1) / max(1, len(t.chunks) - 1))
        itl.extend(float(g) / per_chunk for g in np.diff(t.chunks))
    e2e = [t.chunks[-1] - t.sent for t in ok]
    out_tokens = sum(t.output_tokens for t in ok)
    prompt_tokens = sum(len(w.prompt_token_ids) for w in items)
    good = sum(a * 1e3 <= b.slo.ttft_ms and p * 1e3 <= b.slo.tpot_ms for a, p in zip(ttft, tpot))
    errors = [t.error for t in timings if t.error is not None]
    return {
        "backend": "http", "url": url, "seconds": seconds, "num_requests": len(items), "num_errors": len(errors),
        "errors": errors[:10], "requests_per_s": len(ok) / seconds, "output_tokens_per_s": out_tokens / seconds,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / seconds, "goodput_requests_per_s": good / seconds,
        "slo": {"ttft_ms": b.slo.ttft_ms, "tpot_ms": b.slo.tpot_ms},
        "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot), "itl_s": percentiles(itl), "e2e_s": percentiles(e2e),
    }


@contextlib.contextmanager
def serve_in_thread(cfg: Config) -> Iterator[str]:
    """The real server (FastAPI + uvicorn, engine loop thread) on a free loopback port; yields its URL."""
    from jaxcb.server.app import build_app
    from jaxcb.server.run import serve_app_in_thread

    with serve_app_in_thread(build_app(cfg)) as url:
        yield url
