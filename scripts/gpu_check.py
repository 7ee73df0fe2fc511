"""The one prepared GPU check: staged, time-boxed, and reporting as it goes.

    scripts/gpu_check.sh                                 # on the GPU machine (installs .whl/, then this)
    python scripts/gpu_check.py --json gpu_check.json    # where jaxcb's dependencies are installed
    python scripts/gpu_check.py --dry-run                # anywhere: CPU, Pallas interpreter, tiny shapes
    python scripts/gpu_check.py --stages step,engine     # rerun chosen stages (merged into --json)
    scripts/gpu_check.sh --quick --out DIR               # the headline figures in 180 s (scripts/gpu_quick.py)

Stages, in order (scripts/gpu_stages.py; docs/gpu.md says what each prints and what to read):
  preflight   versions, devices, imports, ptxas
  bandwidth   device copy bandwidth on random data: the roofline everything else is held against
  smoke       one kernel call; registers and spills of XLA's PTX for it (ptxas -v)
  correctness kernel (also split 4 ways) and XLA path vs the reference: decode/prefill/mixed, block sizes 16 and 32,
              a cache over 4 GiB
  decode      decode attention against the HBM roofline (with and without split-KV), JAX's own Pallas
              paged_attention beside it
  step        the 8B jitted step at decode batches 16-256 and a prefill chunk: compile time, ms/step,
              tok/s, dispatch latency; the optimised HLO of one step dumped to --out-dir
  engine      if budget remains: the engine on 8B shapes with random weights, continuous vs static
              batching on ShareGPT-like lengths, out tok/s of each beside the ideal step ratio

Each row of a stage is isolated (a failure costs that row). A watchdog ends the run after
--budget seconds, even inside a compile, after writing the results; the JSON is rewritten
after every row. This script never imports the server (no fastapi/pydantic on the GPU image).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
import traceback

# The checkout this script is in: jaxcb and the lab code it times with (benchmarks/), whatever the caller's path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STAGES = ("preflight", "bandwidth", "smoke", "correctness", "decode", "step", "engine")
EXIT_WATCHDOG = 3


def log(msg: str = "") -> None:
    print(msg, flush=True)


class Report:
    """Results by stage and row, written to `path` (atomically) whenever they change."""

    def __init__(self, path: str | None, meta: dict, keep_previous: bool = True):
        self.path = path
        self.lock = threading.RLock()
        self.data: dict = {"meta": meta, "stages": {}}
        if keep_previous and path and os.path.exists(path):  # a rerun of some stages keeps the others' results
            with contextlib.suppress(ValueError, OSError):
                with open(path) as f:
                    old = json.load(f)
                self.data["stages"] = old.get("stages", {})
                self.data["previous_meta"] = old.get("meta")

    def stage(self, name: str) -> dict:
        with self.lock:
            self.data["stages"][name] = entry = {"status": "running", "rows": [], "errors": [], "seconds": 0.0}
            self.write()
            return entry

    def write(self) -> None:
        if not self.path:
            return
        with self.lock:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1, default=str)
            os.replace(tmp, self.path)

    def failures(self) -> list[str]:
        out = []
        for name, st in self.data["stages"].items():
            out += [f"{name}: {e}" for e in st["errors"]]
            if st["status"] in ("failed", "timeout") and not st["errors"]:
                out.append(f"{name}: {st['status']}")
        return out


class Stage:
    """What a stage function gets: the run's settings, a row recorder, and the time left."""

    def __init__(self, check: "Check", name: str, entry: dict):
        self.check, self.name, self.entry = check, name, entry
        self.dry_run = check.dry_run
        self.state = check.state  # shared between stages: the copy bandwidth, the model

    @property
    def seconds_left(self) -> float:
        return self.check.deadline - time.monotonic()

    @contextlib.contextmanager
    def row(self, label: str, **fields):
        """One isolated row: its fields are recorded, an exception costs this row only."""
        record = {"row": label, **fields}
        start = time.perf_counter()
        try:
            yield record
            record.setdefault("ok", True)
        except Exception as e:  # report and go on: one run must say as much as it can
            record["ok"] = False
            record["error"] = f"{type(e).__name__}: {e}"[:2000]
            self.entry["errors"].append(f"{label}: {record['error'][:300]}")
            log(f"  {label}: FAILED {record['error'][:500]}")
            traceback.print_exc(limit=4)
        finally:
            record["seconds"] = round(time.perf_counter() - start, 3)
            with self.check.report.lock:
                self.entry["rows"].append(record)
                self.check.report.write()

    def note(self, key: str, value) -> None:
        with self.check.report.lock:
            self.entry[key] = value
            self.check.report.write()


class Check:
    """Runs stages, each a function of a `Stage`, from `stages` (a module: default gpu_stages), with
    its MIN_SECONDS floors; `keep_previous`: a rerun keeps the earlier results of stages not rerun."""

    def __init__(self, args: argparse.Namespace, stages=None, keep_previous: bool = True):
        if stages is None:
            import gpu_stages as stages
        self.stages = stages
        self.dry_run = args.dry_run
        self.out_dir = args.out_dir
        self.deadline = time.monotonic() + args.budget
        self.state: dict = {}
        meta = dict(
            command=" ".join(sys.argv), started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), budget_s=args.budget,
            dry_run=args.dry_run,
        )
        self.report = Report(args.json, meta, keep_previous)
        earlier = self.report.data["stages"].get("bandwidth", {}).get("copy_bw_gbs")
        if earlier:  # a rerun of later stages holds them against the bandwidth measured before
            self.state["copy_bw"] = earlier * 1e9
        self.current: str | None = None

    def run(self, names: list[str]) -> int:
        self.names = names
        self.start_watchdog()
        for name in names:
            self.current = name
            entry = self.report.stage(name)
            log(f"\n## {name}\n")
            if "abort" in self.state:
                entry["status"] = "skipped"
                entry["reason"] = self.state["abort"]
                log(f"skipped: {entry['reason']}")
                self.report.write()
                continue
            min_s = getattr(self.stages, "MIN_SECONDS", {}).get(name, 0) * (0.05 if self.dry_run else 1)
            if time.monotonic() + min_s > self.deadline:
                entry["status"] = "skipped"
                entry["reason"] = f"under {min_s:.0f} s of the budget left"
                log(f"skipped: {entry['reason']}")
                self.report.write()
                continue
            start = time.perf_counter()
            try:
                getattr(self.stages, name)(Stage(self, name, entry))
                entry["status"] = "failed" if entry["errors"] else "ok"
            except Exception as e:  # a stage that could not go on at all
                entry["status"] = "failed"
                entry["errors"].append(f"{type(e).__name__}: {e}"[:2000])
                log(f"FAILED: {type(e).__name__}: {e}")
                traceback.print_exc(limit=6)
            entry["seconds"] = round(time.perf_counter() - start, 2)
            log(f"\n({entry['seconds']:.1f} s, {entry['status']})")
            self.report.write()
        self.current = None
        return self.finish()

    def finish(self) -> int:
        failures = self.report.failures()
        self.report.data["failures"] = failures
        self.report.write()
        log("\n" + ("ALL CHECKS PASSED" if not failures else "FAILURES:\n" + "\n".join(failures)))
        return 1 if failures else 0

    def start_watchdog(self) -> None:
        def watch():
            while time.monotonic() < self.deadline:
                time.sleep(0.5)
            with self.report.lock:
                if self.current is not None:
                    entry = self.report.data["stages"][self.current]
                    entry["status"] = "timeout"
                    entry["errors"].append("the --budget ran out during this stage (watchdog)")
                for later in self.names[self.names.index(self.current) + 1:] if self.current else ():
                    self.report.data["stages"][later] = {"status": "skipped", "reason": "budget", "rows": [],
                                                         "errors": []}
                log(f"\nWATCHDOG: the budget is spent during stage {self.current}; results written, exiting")
                self.finish()
            os._exit(EXIT_WATCHDOG)  # a compile in flight cannot be interrupted otherwise

        threading.Thread(target=watch, daemon=True, name="gpu-check-watchdog").start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, Pallas interpreter, tiny shapes")
    parser.add_argument("--json", help="write the results as JSON here, after every row")
    parser.add_argument("--budget", type=float, default=300.0, help="total seconds; the watchdog exits after")
    parser.add_argument("--stages", help=f"comma-separated subset of {','.join(STAGES)} (default: all)")
    parser.add_argument("--out-dir", default="gpu_check_out", help="dumped HLO and PTX go here")
    args = parser.parse_args()
    names = list(STAGES) if not args.stages else [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in names if s not in STAGES]
    if unknown:
        parser.error(f"--stages: unknown {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    os.makedirs(args.out_dir, exist_ok=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    log(f"# jaxcb GPU check{' (dry run: CPU, interpret mode, tiny shapes)' if args.dry_run else ''}, "
        f"budget {args.budget:.0f} s, stages {','.join(names)}")
    sys.exit(Check(args).run(names))


if __name__ == "__main__":
    main()
