"""Does the packed C++ matmul earn its place? It against the best XLA:CPU's own libraries give, end to end.

    python benchmarks/matmul_choice.py --rounds 3 -- model=small bench.num_requests=32
    python benchmarks/matmul_choice.py --rounds 3 -- model=smollm2 bench.workload=random \\
        bench.num_requests=64 bench.input_mean=48 bench.output_mean=96 bench.scale=1

Runs `scripts/bench.py` (offline, the Hydra overrides after `--`) once per variant per round,
each in a fresh process, interleaved (A B C D, A B C D, ...) so that every variant meets the
same spells of a shared machine; then prints each run's output tokens/s, and per variant the
median over rounds of (packed / variant) measured within one round. The packed matmul stays
the default on CPU while it beats the best library variant by >= 1.2x (docs/perf-notes.md).

The variants (XLA_FLAGS are read once per process, hence one process per run):
- packed       model.backend=cpu: weights packed once at load, jaxcb's kernel;
- xla          model.backend=xla: jaxlib 0.11's own choice, which sends f32 dots to YNNPACK;
- xla-eigen    the same with --xla_cpu_experimental_ynn_fusion_type= : XLA's own dot emitter;
- xla-onednn   --xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot: oneDNN.
(`--xla_cpu_use_onednn=true` alone, and the XNNPACK flags `--xla_cpu_use_xnnpack`,
`--xla_cpu_experimental_xnn_fusion_type=dot`, are accepted by jaxlib 0.11.2 but leave the dot
where it was; --check shows what each variant's flags do to one dot of the model's MLP shape.)
Any model the overrides name runs: `model=small` (random weights) is the rule's reference,
`model=smollm2` (the real SmolLM2-135M, dequantized to float32 at load) the check on real weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEP_RATIO = 1.2  # the packed matmul stays the default while it wins by at least this much

VARIANTS = {  # name: (Hydra overrides, XLA_FLAGS)
    "packed": (["model.backend=cpu"], ""),
    "xla": (["model.backend=xla"], ""),
    "xla-eigen": (["model.backend=xla"], "--xla_cpu_experimental_ynn_fusion_type="),
    "xla-onednn": (["model.backend=xla"],
                   "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot"),
}

# One f32 dot compiled under the variant's flags: which library the optimised HLO hands it to.
CHECK = """
import sys
import jax, jax.numpy as jnp
hidden, intermediate = map(int, sys.argv[1:3])
hlo = jax.jit(lambda x, w: x @ w).lower(jnp.ones((64, hidden)), jnp.ones((hidden, intermediate))).compile().as_text()
kinds = [k for k in ("__ynn_fusion", "__onednn_fusion", "__xnn_fusion") if k in hlo]
print(kinds[0].strip("_") if kinds else "XLA's own dot")
"""


def environment(xla_flags: str) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), xla_flags) if f)
    return env


def mlp_shape(overrides: list[str]) -> tuple[int, int]:
    """(hidden, intermediate) of the model the overrides name, as scripts/bench.py would build it."""
    from jaxcb.config import compose_config
    from jaxcb.model.config import resolve_llama_config

    model = resolve_llama_config(compose_config([o for o in overrides if o.startswith("model")]).model)
    return model.hidden_size, model.intermediate_size


def dot_library(xla_flags: str, shape: tuple[int, int]) -> str:
    done = subprocess.run([sys.executable, "-c", CHECK, *map(str, shape)], env=environment(xla_flags),
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else f"failed: {done.stderr.strip()[-300:]}"


def run_bench(name: str, overrides: list[str], out_dir: str) -> float:
    """One offline run of scripts/bench.py; its output tokens/s."""
    variant_overrides, xla_flags = VARIANTS[name]
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "bench.py"), *overrides, *variant_overrides,
         f"hydra.run.dir={out_dir}"],
        env=environment(xla_flags), capture_output=True, text=True,
    )
    if done.returncode != 0:
        sys.exit(f"error: {name} failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(out_dir, "bench.json")) as f:
        result = json.load(f)
    return next(iter(result["runs"].values()))["output_tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--check", action="store_true", help="only show which library each variant's flags pick")
    parser.add_argument("--out", help="where the runs' directories and summary.json go (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for scripts/bench.py, after --")
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or "packed" not in names:
        parser.error(f"--variants={args.variants}: needs packed, and only {', '.join(VARIANTS)}")
    if any(o.startswith("model.backend=") for o in args.overrides):
        parser.error("model.backend is the variant's to set; leave it out of the overrides")

    shape = mlp_shape(args.overrides)
    print(f"the check's dot: [64, {shape[0]}] x [{shape[0]}, {shape[1]}] (the model's MLP)")
    for name in names:
        print(f"{name:11s} XLA_FLAGS={VARIANTS[name][1] or '(none)'}: "
              + ("linear layers -> jaxcb's packed matmul" if name == "packed"
                 else f"an f32 dot -> {dot_library(VARIANTS[name][1], shape)}"))
    if args.check:
        return
    out = args.out or tempfile.mkdtemp(prefix="matmul-choice-")
    tok_s: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names:
            tok_s[name].append(run_bench(name, args.overrides, os.path.join(out, f"{r}-{name}")))
        print(f"round {r + 1}: " + ", ".join(f"{n} {tok_s[n][-1]:,.1f}" for n in names) + " out tok/s", flush=True)

    ratios = {n: [p / v for p, v in zip(tok_s["packed"], tok_s[n])] for n in names if n != "packed"}
    print("\n| variant | out tok/s, round by round | median | packed / variant, round by round | median |")
    print("|---|---|---|---|---|")
    for n in names:
        by_round = ", ".join(f"{v:,.1f}" for v in tok_s[n])
        ratio = ", ".join(f"{x:.2f}x" for x in ratios.get(n, []))
        median_ratio = f"**{statistics.median(ratios[n]):.2f}x**" if n in ratios else ""
        print(f"| {n} | {by_round} | {statistics.median(tok_s[n]):,.1f} | {ratio} | {median_ratio} |")
    if ratios:
        best = min(ratios, key=lambda n: statistics.median(ratios[n]))
        margin = statistics.median(ratios[best])
        verdict = "keep the packed matmul" if margin >= KEEP_RATIO else "the packed matmul does not earn its place"
        print(f"\nbest library variant: {best}; packed / {best} = {margin:.2f}x (rule: keep at >= {KEEP_RATIO}x): "
              f"{verdict}")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"overrides": args.overrides, "out_tokens_per_s": tok_s, "packed_over_variant": ratios}, f, indent=2)
    print(f"runs and summary.json: {out}")


if __name__ == "__main__":
    main()
