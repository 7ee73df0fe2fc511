"""Speculative decoding against plain decoding: two engines in one process (speculative.method=none and
ngram or draft, otherwise the same config), the same requests in turns (the order flipped every round),
so both see the same spells of other work on the machine.

    python benchmarks/speculative.py --rounds 3 -- model=smollm2
    python benchmarks/speculative.py --method draft --spec speculative.draft_model=smollm2 -- model=smollm2

`--spec` overrides go to the speculating engine only (its draft model, k, back-off).

Workloads:

- `edit`: rewriting text from this repository with one change, the work n-gram proposals are for --
  paragraphs of README.md and docs/architecture.md ("repeat this paragraph, with X in place of Y") and
  functions of jaxcb/ ("repeat this code with the function renamed"), through the chat template,
  greedy, each request's max_tokens its source's length in tokens;
- `lognormal`: `bench.workload=lognormal` (random token ids as prompts), greedy: a small model often
  answers those by repeating itself, which proposals find;
- `sampled`: the same prompts sampled at temperature 1 (seeded, so both engines draw the same
  tokens): outputs that rarely repeat, where proposals mostly fail and speculation must stand aside.

Each runs at batch 1 (one request at a time) and batch 8 (eight at once). Prints output tokens/s of
both engines, their ratio (median over rounds), the acceptance (accepted / proposed tokens, and the
tokens a verify step yields: 1 + its accepted drafts), that the outputs are equal token for token
(sampled outputs with a draft model are equal in distribution, not token for token: not compared),
and that neither engine recompiled.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from jaxcb.benchmark import make_workload  # noqa: E402
from jaxcb.config import compose_config  # noqa: E402
from jaxcb.engine import LLM  # noqa: E402
from jaxcb.sampling_params import SamplingParams  # noqa: E402


def _paragraphs(path: str, min_chars: int = 300, max_chars: int = 900) -> list[str]:
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    out = []
    for block in text.split("\n\n"):
        block = block.strip()
        if min_chars <= len(block) <= max_chars and not block.startswith(("```", "|", "#", "-")):
            out.append(block)
    return out


def _functions(path: str, min_chars: int = 300, max_chars: int = 1200) -> list[tuple[str, str]]:
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    out = []
    for m in re.finditer(r"\n(    )?def (\w+)\(.*?(?=\n(?:    )?(?:def |class |@)|\Z)", text, re.S):
        body = m.group(0).strip("\n")
        if min_chars <= len(body) <= max_chars:
            out.append((m.group(2), body))
    return out


def edit_requests(tokenizer, num: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) of `num` rewriting requests built from the repository's own text."""
    asks = []
    for path in ("README.md", "docs/architecture.md"):
        for p in _paragraphs(path):
            words = [w for w in re.findall(r"[A-Za-z]{6,}", p)]
            if words:
                asks.append((f"Repeat this paragraph exactly, but write \"{words[len(words) // 2].upper()}\" "
                             f"in place of \"{words[len(words) // 2]}\":\n\n{p}", p))
    for path in ("jaxcb/core/scheduler.py", "jaxcb/output.py", "jaxcb/core/kv_cache_manager.py"):
        for name, body in _functions(path):
            asks.append((f"Repeat this Python code exactly, with the function renamed to `{name}_v2`:\n\n{body}",
                         body))
    asks = asks[:num]
    out = []
    for ask, source in asks:
        text = tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        out.append((ids, len(tokenizer.encode(source, add_special_tokens=False)) + 16))
    return out


def run(llm: LLM, requests: list[tuple[list[int], int]], batch: int, temperature: float = 0.0
        ) -> tuple[float, list[list[int]]]:
    """(output tokens/s, each request's tokens), `batch` requests at a time."""
    outputs = []
    start = time.perf_counter()
    for at in range(0, len(requests), batch):
        chunk = requests[at : at + batch]
        params = [SamplingParams(max_tokens=m, temperature=temperature, seed=at + i)
                  for i, (_, m) in enumerate(chunk)]
        outputs += [o.outputs[0].token_ids for o in llm.generate([p for p, _ in chunk], params, use_tqdm=False)]
    elapsed = time.perf_counter() - start
    return sum(map(len, outputs)) / elapsed, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16, help="requests per workload and round")
    parser.add_argument("--workloads", default="edit,lognormal,sampled")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--method", default="ngram", choices=("ngram", "draft"))
    parser.add_argument("--spec", action="append", default=[], help="an override for the speculating engine only")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both engines (and bench.* for lognormal)")
    args = parser.parse_args()
    method = args.method
    llms = {"none": LLM(compose_config([*args.overrides, "speculative.method=none"])),
            method: LLM(compose_config([*args.overrides, f"speculative.method={method}", *args.spec]))}
    engine = llms[method].engine
    workloads = {}
    if "edit" in args.workloads:
        workloads["edit"] = edit_requests(engine.tokenizer, args.requests)
    items = make_workload(compose_config([*args.overrides, f"bench.num_requests={args.requests}"]).bench,
                          engine.model_config.vocab_size, engine.max_model_len)
    for name in ("lognormal", "sampled"):
        if name in args.workloads:
            workloads[name] = [(list(i.prompt_token_ids), i.output_len) for i in items]
    print(f"speculative decoding: {engine.cfg.speculative}")
    for name, requests in workloads.items():
        for batch in map(int, args.batches.split(",")):
            rates: dict[str, list[float]] = {"none": [], method: []}
            outputs = {}
            before = engine.speculation.stats
            drafts0, proposed0, accepted0 = before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens
            for i in range(args.rounds):
                for m in ("none", method) if i % 2 == 0 else (method, "none"):
                    rate, outputs[m] = run(llms[m], requests, batch, 1.0 if name == "sampled" else 0.0)
                    rates[m].append(rate)
            s = engine.speculation.stats
            drafts, proposed, accepted = (s.num_drafts - drafts0, s.num_draft_tokens - proposed0,
                                          s.num_accepted_tokens - accepted0)
            ratio = statistics.median(b / a for a, b in zip(rates["none"], rates[method]))
            equal = ("not compared (sampled: equal in distribution)" if method == "draft" and name == "sampled"
                     else outputs["none"] == outputs[method])
            print(f"{name}, batch {batch}: off {statistics.median(rates['none']):,.1f} out tok/s, "
                  f"{method} {statistics.median(rates[method]):,.1f} -> {ratio:.2f}x (median of {args.rounds}); "
                  f"accepted {accepted}/{proposed} proposed tokens ({accepted / max(proposed, 1):.0%}), "
                  f"{1 + accepted / max(drafts, 1):.2f} tokens a verify step; outputs equal: {equal}", flush=True)
    print(f"recompiles: off {llms['none'].engine.num_recompiles}, {method} {engine.num_recompiles}")


if __name__ == "__main__":
    main()
