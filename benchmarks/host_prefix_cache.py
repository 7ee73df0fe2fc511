"""What the prefix cache's host tier buys when the conversations' prefixes do not fit the device cache.

    python benchmarks/host_prefix_cache.py                         # offline, SmolLM2, the defaults below
    python benchmarks/host_prefix_cache.py --mode http             # the same conversations over HTTP
    python benchmarks/host_prefix_cache.py --conversations 8 model=tiny   # any Hydra overrides of the engine

The workload: `--conversations` conversations share one `--system-len`-token system prompt; each
turn adds `--user-len` tokens of the user's and the model's reply of `--reply-len` tokens (greedy,
ignore_eos), and the next turn's prompt is the whole conversation so far. Token ids are random past
the tokenizer's leading special tokens (`--seed`). The device cache is `cache.num_blocks` blocks
(the default holds about a third of the working set: every conversation's history plus the system
prompt), so between a conversation's turns the other conversations evict its history.

Each run builds the engine with the host tier off (cache.host_prefix_cache_gib=0) and on
(`--tier-gib`), in turns (`--rounds` pairs):
- offline: every conversation's turn t is submitted at once; a line per run with the wall seconds,
  the prompt tokens found in the prefix cache (device and host tier) and the prompt tokens computed.
- http: the real server in this process; one client per conversation sends its next turn when the
  previous reply is back (streamed /v1/chat/completions: a system message, then the turns so far, as
  text of random words -- `--system-len` and `--user-len` are then about that many tokens); a line per
  run with the wall seconds, TTFT p50/p99 and the prompt tokens the server reported cached
  (usage.prompt_tokens_details.cached_tokens).
Then the on/off ratios, and whether the greedy replies of on and off were identical, turn by turn.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULTS = ["model=smollm2", "scheduler.max_num_seqs=4", "scheduler.max_num_batched_tokens=512",
            "engine.max_model_len=1024", "cache.num_blocks=161"]
FIRST_TOKEN_ID = 17  # SmolLM2's special tokens are 0..16


def conversations(a: argparse.Namespace, seed: int, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    """(the system prompt, each conversation's user turns)."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]  # noqa: E731
    return draw(a.system_len), [[draw(a.user_len) for _ in range(a.turns)] for _ in range(a.conversations)]


def run_offline(cfg, a, seed: int) -> dict:
    from jaxcb.engine import Engine
    from jaxcb.sampling_params import SamplingParams

    engine = Engine(cfg, progress=False)
    system, users = conversations(a, seed, engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=a.reply_len, ignore_eos=True)
    histories = [list(system) for _ in users]
    replies, computed = [], 0
    start = time.perf_counter()
    for turn in range(a.turns):
        ids = {}
        for c, history in enumerate(histories):
            history += users[c][turn]
            ids[engine.add_request(list(history), params)] = c
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[ids[out.request_id]] = out.outputs[0].token_ids
        for c in range(len(histories)):
            histories[c] += done[c]
            replies.append(done[c])
    seconds = time.perf_counter() - start
    stats = engine.step_with_stats()[1]
    queries = stats.prefix_cache_queries
    computed = queries - stats.prefix_cache_hits
    return {"seconds": seconds, "hits": stats.prefix_cache_hits, "host_hits": stats.host_prefix_cache_hits,
            "computed": computed, "replies": replies, "recompiles": engine.num_recompiles,
            "to_host_mib": stats.host_tier_bytes_to_host / 2**20, "to_device_mib": stats.host_tier_bytes_to_device / 2**20}


def chat_conversations(a: argparse.Namespace, seed: int) -> tuple[str, list[list[str]]]:
    """(the system prompt, each conversation's user turns) as text: words of random letters (about two
    tokens each), so that the server's chat template and tokenizer make the prompts as a client's would."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(3000)]
    text = lambda n: " ".join(rng.choice(words) for _ in range(n // 2))  # noqa: E731
    return text(a.system_len), [[text(a.user_len) for _ in range(a.turns)] for _ in range(a.conversations)]


async def _conversation(client, url, model, system, users, a, ttfts, replies, cached) -> None:
    import json

    messages = [{"role": "system", "content": system}]
    for turn, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        body = {"model": model, "messages": messages, "max_tokens": a.reply_len, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        sent, first, reply = time.perf_counter(), None, ""
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"turn {turn}: HTTP {response.status_code}: {(await response.aread()).decode()}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    cached.append(chunk["usage"]["prompt_tokens_details"]["cached_tokens"])
                for choice in chunk.get("choices", []):
                    piece = choice["delta"].get("content") or ""
                    if first is None and piece:
                        first = time.perf_counter()
                    reply += piece
        ttfts.append(first - sent)
        replies[turn] = reply
        messages.append({"role": "assistant", "content": reply})


def run_http(cfg, a, seed: int) -> dict:
    import httpx

    from jaxcb.bench_http import served_model, serve_in_thread

    system, users = chat_conversations(a, seed)
    with serve_in_thread(cfg) as url:
        model = served_model(url)
        ttfts, cached = [], []
        replies = [[None] * a.turns for _ in users]

        async def main():
            async with httpx.AsyncClient(timeout=600) as client:
                await asyncio.gather(*(_conversation(client, url, model, system, u, a, ttfts, r, cached)
                                       for u, r in zip(users, replies)))

        start = time.perf_counter()
        asyncio.run(main())
        seconds = time.perf_counter() - start
    ttfts.sort()
    return {"seconds": seconds, "ttft_p50": statistics.median(ttfts),
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], "hits": sum(cached),
            "replies": [x for r in replies for x in r]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("offline", "http"), default="offline")
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--reply-len", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tier-gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a, overrides = p.parse_known_args()

    from jaxcb.config import compose_config

    run = run_offline if a.mode == "offline" else run_http
    ratios = []
    for r in range(a.rounds):
        results = {}
        for name, gib in (("off", 0.0), ("on", a.tier_gib)):
            # http: every conversation may wait at once; the server's admission control would refuse them with a
            # cache this small (twice the cache's tokens waiting).
            extra = ["scheduler.max_waiting_tokens=100000000"] if a.mode == "http" else []
            cfg = compose_config(DEFAULTS + extra + overrides + [f"cache.host_prefix_cache_gib={gib}"])
            res = results[name] = run(cfg, a, a.seed + r)
            extra = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items() if k != "replies"}
            print(f"round {r} tier {name}: {extra}", flush=True)
        same = results["on"]["replies"] == results["off"]["replies"]
        ratio = results["off"]["seconds"] / results["on"]["seconds"]
        ratios.append(ratio)
        print(f"round {r}: off/on wall {ratio:.2f}x, prefix-hit tokens {results['off']['hits']} -> "
              f"{results['on']['hits']}, greedy replies identical: {same}", flush=True)
    print(f"median off/on wall over {a.rounds} rounds: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
