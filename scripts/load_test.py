"""Load test of a running jaxcb server: N concurrent streaming clients for S seconds (loopback only).

    python scripts/serve.py scheduler.max_num_seqs=256 &          # in one terminal
    python scripts/load_test.py --concurrency 256 --duration 30   # in another

Each client sends streaming completions back to back (random prompt lengths and output
lengths, seeded) and measures TTFT (request sent -> first token) and TPOT (mean time per
output token after the first). Prints errors (should be 0), TTFT/TPOT p50/p95/p99 and
output tokens/s, and writes them as JSON with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import statistics
import sys
import time
import urllib.parse

import httpx

MAX_CONCURRENCY = 2048
MAX_DURATION_S = 600


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def client_loop(url, model, deadline, rng, stats, args):
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as http:
        while time.monotonic() < deadline:
            body = {
                "model": model, "prompt": [rng.randrange(1, 250) for _ in range(rng.randint(*args.prompt_len))],
                "max_tokens": rng.randint(*args.output_len), "temperature": 0.8, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True},
            }
            start = time.monotonic()
            first = last = None
            tokens = 0
            try:
                async with http.stream("POST", url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        stats["errors"].append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            stats["errors"].append(chunk["error"]["message"])
                            break
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                        elif chunk["choices"]:
                            now = time.monotonic()
                            first = first or now
                            last = now
            except httpx.HTTPError as e:
                stats["errors"].append(f"{type(e).__name__}: {e}")
                continue
            if first is None:
                stats["errors"].append("no token received")
                continue
            stats["ttft"].append(first - start)
            if tokens > 1:
                stats["tpot"].append((last - first) / (tokens - 1))
            stats["tokens"] += tokens
            stats["requests"] += 1


async def run(args) -> dict:
    host = urllib.parse.urlparse(args.url).hostname or ""
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        sys.exit(f"error: {args.url} is not a loopback address; this tool only loads a local server")
    async with httpx.AsyncClient() as http:
        model = (await http.get(args.url + "/v1/models")).json()["data"][0]["id"]
    stats = {"errors": [], "ttft": [], "tpot": [], "tokens": 0, "requests": 0}
    start = time.monotonic()
    deadline = start + args.duration
    await asyncio.gather(*(
        client_loop(args.url, model, deadline, random.Random(args.seed + i), stats, args) for i in range(args.concurrency)
    ))
    elapsed = time.monotonic() - start
    ms = lambda v: round(1000 * v, 2)  # noqa: E731
    return {
        "concurrency": args.concurrency, "duration_s": round(elapsed, 2), "requests": stats["requests"],
        "errors": len(stats["errors"]), "error_samples": stats["errors"][:5],
        "output_tokens_per_s": round(stats["tokens"] / elapsed, 1),
        "ttft_ms": {f"p{q}": ms(percentile(stats["ttft"], q)) for q in (50, 95, 99)},
        "tpot_ms": {f"p{q}": ms(percentile(stats["tpot"], q)) for q in (50, 95, 99)},
        "ttft_mean_ms": ms(statistics.fmean(stats["ttft"])) if stats["ttft"] else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    if not 1 <= args.concurrency <= MAX_CONCURRENCY or not 0 < args.duration <= MAX_DURATION_S:
        sys.exit(f"error: --concurrency must be 1..{MAX_CONCURRENCY} and --duration 0..{MAX_DURATION_S} s")
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    sys.exit(1 if result["errors"] else 0)


if __name__ == "__main__":
    main()
