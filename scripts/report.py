"""Summarise a serving sweep: a CSV, a table, two plots, and a recommendation only where the runs back one.

    python scripts/bench.py -m bench.mode=serving bench.request_rate=200 bench.num_requests=1000 \\
        scheduler.max_num_seqs=4,16,64,64 scheduler.max_num_batched_tokens=128,512 hydra.sweep.dir=outputs/sweep
    python scripts/report.py outputs/sweep [outputs/another-sweep ...]

Reads every run directory of the sweeps given (its .hydra/overrides.yaml and bench.json). Runs
with the same overrides are repeats of one configuration (above, `64,64` runs max_num_seqs=64
twice at each budget); every figure is the mean of a configuration's repeats. A metric's
run-to-run noise is its largest relative spread, (max - min) / mean, between repeats of one
configuration.

Settings are ranked by goodput (requests/s meeting bench.slo), or by output tokens/s where no
run met the SLO. The best is recommended only when it beats every other setting by more than
that metric's noise; when the runner-up is within the noise, or the sweep repeats no
configuration (the noise is unknown), the report says so and recommends nothing. Load keys (bench.request_rate,
bench.max_concurrency, bench.num_requests, bench.seed) are not settings: each load gets its own
verdict. Along scheduler.max_num_seqs, each curve's knee is the smallest value whose throughput
is within the noise of the curve's best.

Writes sweep.csv (one row per run), sweep.md (one row per configuration) and two plots,
throughput against p99 TTFT and against mean TPOT, from zero, each point with a bar of +-the
throughput noise.
Runs that failed (no bench.json) are listed, not dropped.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

LOAD_KEYS = ("bench.request_rate", "bench.max_concurrency", "bench.num_requests", "bench.seed")
LABEL_KEY = "scheduler.max_num_seqs"  # the x-axis of a knee, and each point's label on the plots
METRICS = ("output_tokens_per_s", "requests_per_s", "goodput_requests_per_s", "ttft_p99_ms", "tpot_mean_ms")
FIELDS = ["run", "max_num_seqs", "max_num_batched_tokens", "request_rate", "status", *METRICS, "overrides"]


def load_runs(sweep_dirs: list[str]) -> list[dict]:
    """One row per run directory (`<sweep>/<n>/`), its overrides parsed into `params`."""
    runs = []
    for sweep_dir in sweep_dirs:
        names = sorted(os.listdir(sweep_dir), key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else n))
        for name in names:
            run_dir = os.path.join(sweep_dir, name)
            overrides_path = os.path.join(run_dir, ".hydra", "overrides.yaml")
            if not os.path.isfile(overrides_path):
                continue
            with open(overrides_path) as f:
                overrides = yaml.safe_load(f) or []
            params = dict(o.split("=", 1) for o in overrides if "=" in o)
            row = {"run": name if len(sweep_dirs) == 1 else os.path.join(os.path.basename(sweep_dir.rstrip("/")), name),
                   "overrides": " ".join(overrides), "params": params,
                   "max_num_seqs": params.get("scheduler.max_num_seqs", ""),
                   "max_num_batched_tokens": params.get("scheduler.max_num_batched_tokens", ""),
                   "request_rate": params.get("bench.request_rate", "")}
            result_path = os.path.join(run_dir, "bench.json")
            if not os.path.isfile(result_path):
                runs.append(dict(row, status="failed (no bench.json)"))
                continue
            with open(result_path) as f:
                result = json.load(f)
            serving = next(iter(result.get("serving", {}).values()), None)
            if serving is None:
                runs.append(dict(row, status="failed (not a bench.mode=serving run)"))
                continue
            runs.append(dict(
                row, status="ok",
                output_tokens_per_s=round(serving["output_tokens_per_s"], 1),
                requests_per_s=round(serving["requests_per_s"], 3),
                goodput_requests_per_s=round(serving["goodput_requests_per_s"], 3),
                ttft_p99_ms=round(1e3 * serving["ttft_s"]["p99"], 2),
                tpot_mean_ms=round(1e3 * serving["tpot_s"]["mean"], 3),
            ))
    return runs


@dataclass
class Setting:
    """One configuration of the sweep: its runs' mean figures."""

    params: dict[str, str]
    runs: list[dict]
    mean: dict[str, float] = field(init=False)

    def __post_init__(self) -> None:
        self.mean = {m: statistics.fmean(r[m] for r in self.runs) for m in METRICS}

    def describe(self, keys: list[str]) -> str:
        return " ".join(f"{k}={self.params.get(k, '(default)')}" for k in keys) or "(the defaults)"


def group_settings(ok_runs: list[dict]) -> list[Setting]:
    groups: dict[tuple, list[dict]] = {}
    for r in ok_runs:
        groups.setdefault(tuple(sorted(r["params"].items())), []).append(r)
    return [Setting(dict(key), runs) for key, runs in groups.items()]


def run_to_run_noise(settings: list[Setting], metric: str) -> Optional[float]:
    """The largest (max - min) / mean of `metric` between repeats of one setting; None when no
    setting was run twice (or every repeated one read 0)."""
    spreads = []
    for s in settings:
        values = [r[metric] for r in s.runs]
        if len(values) > 1 and statistics.fmean(values) > 0:
            spreads.append((max(values) - min(values)) / statistics.fmean(values))
    return max(spreads) if spreads else None


def swept_keys(settings: list[Setting]) -> list[str]:
    keys = sorted({k for s in settings for k in s.params})
    return [k for k in keys if len({s.params.get(k) for s in settings}) > 1]


def as_number(value: Optional[str]) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("inf")  # null (all at once) sorts last


@dataclass
class Verdict:
    load: str  # "" when the sweep has one load
    metric: str
    ranked: list[Setting]  # best first
    recommended: Optional[Setting]
    message: str


def judge(settings: list[Setting], noise: dict[str, Optional[float]], setting_keys: list[str],
          load: str = "") -> Verdict:
    """Rank one load's settings and recommend the best only if it clears the noise of the ranking metric."""
    metric = "goodput_requests_per_s" if any(s.mean["goodput_requests_per_s"] > 0 for s in settings) \
        else "output_tokens_per_s"
    noise = noise[metric]
    unit = "req/s goodput" if metric == "goodput_requests_per_s" else "out tok/s"
    ranked = sorted(settings, key=lambda s: (s.mean[metric], s.mean["output_tokens_per_s"]), reverse=True)
    best = ranked[0]
    prefix = f"{load}: " if load else ""
    if metric == "output_tokens_per_s":
        prefix += ("no run met the SLO (goodput 0 everywhere): settings ranked by throughput; loosen "
                   "bench.slo.ttft_ms / bench.slo.tpot_ms or lower bench.request_rate to rank by goodput. ")
    if len(ranked) == 1:
        return Verdict(load, metric, ranked, None, prefix + "no recommendation: only one setting was run")
    if noise is None:
        return Verdict(load, metric, ranked, None, prefix + (
            "no recommendation: no setting was run twice, so the run-to-run noise is unknown; repeat one "
            f"(list a value twice, e.g. {LABEL_KEY}=16,64,64). Best measured: "
            f"{best.describe(setting_keys)} ({best.mean[metric]:,.2f} {unit})"))
    top = best.mean[metric]
    ties = [s for s in ranked[1:] if top - s.mean[metric] <= noise * top]
    if ties:
        return Verdict(load, metric, ranked, None, prefix + (
            f"no recommendation: {len(ties) + 1} settings are within the run-to-run noise "
            f"(+-{100 * noise:.1f}%) of the best ({top:,.2f} {unit}): "
            + "; ".join(s.describe(setting_keys) for s in [best, *ties])))
    second = ranked[1].mean[metric]
    goodput = f"{top:.2f} req/s goodput, " if metric == "goodput_requests_per_s" else ""
    return Verdict(load, metric, ranked, best, prefix + (
        f"recommended: {best.describe(setting_keys)} ({goodput}{best.mean['output_tokens_per_s']:,.0f} out tok/s, "
        f"p99 TTFT {best.mean['ttft_p99_ms']:,.0f} ms, mean TPOT {best.mean['tpot_mean_ms']:.2f} ms): "
        f"{100 * (top - second) / top:.1f}% above the next setting, noise +-{100 * noise:.1f}%"))


def knees(settings: list[Setting], noise: Optional[float], curve_keys: list[str]) -> list[str]:
    """For each curve along max_num_seqs: the smallest value whose throughput is within the noise of
    the curve's best (where more sequences stop buying throughput)."""
    if noise is None:
        return []
    lines = []
    curves: dict[tuple, list[Setting]] = {}
    for s in settings:
        curves.setdefault(tuple(s.params.get(k) for k in curve_keys), []).append(s)
    for key, curve in sorted(curves.items(), key=lambda kv: [as_number(v) for v in kv[0]]):
        if len(curve) < 2:
            continue
        curve.sort(key=lambda s: as_number(s.params.get(LABEL_KEY)))
        tput = [s.mean["output_tokens_per_s"] for s in curve]
        name = " ".join(f"{k}={v}" for k, v in zip(curve_keys, key)) or "all runs"
        if max(tput) - min(tput) <= noise * max(tput):
            lines.append(f"{name}: throughput flat within the noise over {LABEL_KEY}="
                         + ",".join(s.params.get(LABEL_KEY, "?") for s in curve))
            continue
        knee = next(s for s, t in zip(curve, tput) if max(tput) - t <= noise * max(tput))
        if knee is curve[-1]:
            lines.append(f"{name}: throughput still rising at {LABEL_KEY}={knee.params.get(LABEL_KEY)}, the largest "
                         f"swept ({knee.mean['output_tokens_per_s']:,.0f} out tok/s): no knee in this range")
            continue
        lines.append(f"{name}: knee at {LABEL_KEY}={knee.params.get(LABEL_KEY)} "
                     f"({knee.mean['output_tokens_per_s']:,.0f} out tok/s, within the noise of the curve's best "
                     f"{max(tput):,.0f}; p99 TTFT {knee.mean['ttft_p99_ms']:,.0f} ms)")
    return lines


def plot(settings: list[Setting], curve_keys: list[str], noise: Optional[float], recommended: list[Setting],
         x_key: str, x_label: str, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves: dict[tuple, list[Setting]] = {}
    for s in settings:
        curves.setdefault(tuple(s.params.get(k) for k in curve_keys), []).append(s)
    for key, curve in sorted(curves.items(), key=lambda kv: [as_number(v) for v in kv[0]]):
        curve.sort(key=lambda s: as_number(s.params.get(LABEL_KEY)))
        xs = [s.mean[x_key] for s in curve]
        ys = [s.mean["output_tokens_per_s"] for s in curve]
        label = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(curve_keys, key)) or "all runs"
        ax.errorbar(xs, ys, yerr=[noise * y for y in ys] if noise else None, marker="o", capsize=3, label=label)
        for s, x, y in zip(curve, xs, ys):
            ax.annotate(s.params.get(LABEL_KEY, ""), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for s in recommended:
        ax.scatter([s.mean[x_key]], [s.mean["output_tokens_per_s"]], s=220, facecolors="none", edgecolors="red",
                   linewidths=2, label="recommended", zorder=3)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)  # from zero: a 1% spread must not look like a slope
    ax.set_xlabel(x_label)
    ax.set_ylabel("output tokens/s")
    band = f"bars: run-to-run noise +-{100 * noise:.1f}%" if noise is not None else "run-to-run noise unknown (no repeat)"
    ax.set_title(f"throughput vs latency (labels: {LABEL_KEY.split('.')[-1]}; {band})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(settings: list[Setting], keys: list[str]) -> str:
    head = [*keys, "runs", "out tok/s", "goodput req/s", "p99 TTFT (ms)", "mean TPOT (ms)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in sorted(settings, key=lambda s: [as_number(s.params.get(k)) for k in keys]):
        def cell(metric: str, fmt: str) -> str:  # the mean, then each repeat's figure
            each = f" ({', '.join(format(r[metric], fmt) for r in s.runs)})" if len(s.runs) > 1 else ""
            return format(s.mean[metric], fmt) + each

        lines.append("| " + " | ".join([
            *(s.params.get(k, "") for k in keys), str(len(s.runs)), cell("output_tokens_per_s", ",.0f"),
            cell("goodput_requests_per_s", ".2f"), f"{s.mean['ttft_p99_ms']:,.0f}", f"{s.mean['tpot_mean_ms']:.2f}",
        ]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep_dirs", nargs="+", metavar="sweep_dir",
                        help="a sweep's output directory; several are pooled (repeats may come from another sweep)")
    args = parser.parse_args()
    for d in args.sweep_dirs:
        if not os.path.isdir(d):
            sys.exit(f"error: {d} is not a directory; give the sweep's output directory")
    runs = load_runs(args.sweep_dirs)
    if not runs:
        sys.exit(f"error: no runs found under {' '.join(args.sweep_dirs)} (expected <n>/.hydra/overrides.yaml)")
    out_dir = args.sweep_dirs[0]
    csv_path = os.path.join(out_dir, "sweep.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows([{k: r.get(k, "") for k in FIELDS} for r in runs])
    for r in runs:
        if r["status"] != "ok":
            print(f"run {r['run']} ({r['overrides']}): {r['status']}")
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        sys.exit("error: every run of the sweep failed")

    settings = group_settings(ok)
    noise = {m: run_to_run_noise(settings, m) for m in ("goodput_requests_per_s", "output_tokens_per_s")}
    tput_noise = noise["output_tokens_per_s"]
    keys = swept_keys(settings)
    load_keys = [k for k in keys if k in LOAD_KEYS]
    setting_keys = [k for k in keys if k not in LOAD_KEYS]
    curve_keys = [k for k in keys if k != LABEL_KEY]
    table = markdown_table(settings, keys)
    with open(os.path.join(out_dir, "sweep.md"), "w") as f:
        f.write(table + "\n")
    repeated = [s for s in settings if len(s.runs) > 1]
    print(table)
    print(f"\n{len(ok)} runs ok, {len(runs) - len(ok)} failed; {len(settings)} configurations, "
          + (f"{len(repeated)} repeated: run-to-run noise +-{100 * tput_noise:.1f}% in throughput, "
             + (f"+-{100 * noise['goodput_requests_per_s']:.1f}%" if noise["goodput_requests_per_s"] is not None
                else "unknown") + " in goodput" if tput_noise is not None
             else "none repeated: run-to-run noise unknown"))

    loads: dict[tuple, list[Setting]] = {}
    for s in settings:
        loads.setdefault(tuple(s.params.get(k) for k in load_keys), []).append(s)
    verdicts = [judge(group, noise, setting_keys, " ".join(f"{k}={v}" for k, v in zip(load_keys, load)))
                for load, group in sorted(loads.items(), key=lambda kv: [as_number(v) for v in kv[0]])]
    for line in knees(settings, tput_noise, curve_keys):
        print(line)
    for v in verdicts:
        print(v.message)
    recommended = [v.recommended for v in verdicts if v.recommended is not None]
    plot(settings, curve_keys, tput_noise, recommended, "ttft_p99_ms", "p99 TTFT (ms)",
         os.path.join(out_dir, "throughput_vs_ttft.png"))
    plot(settings, curve_keys, tput_noise, recommended, "tpot_mean_ms", "mean TPOT (ms)",
         os.path.join(out_dir, "throughput_vs_tpot.png"))
    print(f"wrote {csv_path}, sweep.md and two plots")


if __name__ == "__main__":
    main()
