"""The GPU check works the first time on the GPU image: tested on the CPU in a venv shaped like it.

The bare venv holds only what the GPU image has that the check may use (its packages at the
image's jax; jaxcb not installed), plus the wheels scripts/gpu_wheels.sh downloads; the check
runs through scripts/gpu_check.sh --dry-run exactly as docs/gpu.md tells. Changing the jax pin
in pyproject.toml changes GPU_IMAGE_PACKAGES here and docs/gpu.md in the same commit.
"""

import json
import os
import re
import subprocess
import sys
import venv

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_CHECK = os.path.join(REPO, "scripts", "gpu_check.py")
STAGES = ["preflight", "bandwidth", "smoke", "correctness", "decode", "step", "engine"]
QUICK_STAGES = ["preflight", "bandwidth", "kernel", "startup", "decode", "serve"]
# What the GPU image (Python 3.12) holds of what jaxcb's check imports; jax at the image's version.
GPU_IMAGE_PACKAGES = [
    "jax==0.11.2", "jaxlib==0.11.2", "flax==0.12.12", "orbax-checkpoint==0.12.8", "numpy", "safetensors",
    "tokenizers", "jinja2", "prometheus-client", "httpx", "tqdm", "pyyaml",
]


def run(cmd, env=None, timeout=900, cwd=REPO):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def clean_env(**extra) -> dict:
    """The environment without this venv's paths, so that nothing of the test venv leaks in."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    root = tmp_path_factory.mktemp("bare")
    venv.create(root / "venv", with_pip=True)
    python = str(root / "venv" / "bin" / "python")
    # The test venv's uv where make installed it (the same packages, downloaded in parallel), else pip.
    # --no-compile: byte-compiling every installed file (jax's thousands) took half the install; the two
    # checks run here compile only the modules they import (uv compiles none).
    uv = os.path.join(os.path.dirname(sys.executable), "uv")
    install = ([uv, "pip", "install", "--quiet", "--python", python] if os.path.isfile(uv) else
               [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile"])
    proc = run([*install, *GPU_IMAGE_PACKAGES], env=clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = root / "wheels"
    proc = run([os.path.join(REPO, "scripts", "gpu_wheels.sh"), str(wheels)], env=clean_env(PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return python, str(wheels)


def test_gpu_check_sh_dry_run_passes_every_stage_in_a_bare_venv(bare_python, tmp_path):
    python, wheels = bare_python
    # Nothing of jaxcb, hydra or the server's stack is installed there.
    probe = run([python, "-c", "import importlib.util as u; print([m for m in ('jaxcb', 'hydra', 'omegaconf', "
                               "'fastapi', 'pydantic', 'uvicorn') if u.find_spec(m)])"], env=clean_env(), cwd=tmp_path)
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr
    out = tmp_path / "out"
    proc = run([os.path.join(REPO, "scripts", "gpu_check.sh"), "--dry-run"],
               env=clean_env(PYTHON=python, GPU_CHECK_WHEELS=wheels, GPU_CHECK_OUT=str(out)))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ALL CHECKS PASSED" in proc.stdout
    results = json.loads((out / "gpu_check.json").read_text())
    assert results["failures"] == []
    assert list(results["stages"]) == STAGES
    assert all(results["stages"][s]["status"] == "ok" and results["stages"][s]["rows"] for s in STAGES)
    impls = {r.get("impl") for r in results["stages"]["decode"]["rows"]}
    # with and without split-KV, and from an fp8 cache
    assert impls == {"pallas", "pallas 1 split", "xla", "jax_paged_attention", "pallas fp8_e4m3"}
    assert any("large cache" in r["row"] or "GiB (K + V)" in r["row"] for r in results["stages"]["correctness"]["rows"])
    assert (out / "step_decode_hlo.txt").read_text().startswith("HloModule")
    engine = {r["row"]: r for r in results["stages"]["engine"]["rows"]}
    assert engine["engine fcfs"]["out_tok_s"] > 0 and engine["engine static"]["out_tok_s"] > 0
    assert engine["continuous / static"]["ideal_step_ratio"] >= 1


def test_gpu_check_sh_quick_dry_run_writes_its_json_and_log_and_nothing_else(bare_python, tmp_path):
    python, wheels = bare_python
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    proc = run([os.path.join(REPO, "scripts", "gpu_check.sh"), "--quick", "--dry-run", "--out", str(out)],
               env=clean_env(PYTHON=python, GPU_CHECK_WHEELS=wheels, TMPDIR=str(tmp)))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert sorted(os.listdir(out)) == ["gpu_quick.json", "gpu_quick.log"]
    assert os.listdir(tmp) == []  # the scratch folder (XLA's dumps, the compilation cache) is gone
    log = (out / "gpu_quick.log").read_text()
    assert "ALL CHECKS PASSED" in log and log in proc.stdout + proc.stderr
    # The plan: every stage with its expected seconds on the H200, and a total within the 180 s budget.
    plan = proc.stdout.split("## plan", 1)[1].split("\n# ", 1)[0]  # up to the check's own heading
    rows = dict(re.findall(r"^\| (\w+) \| (\d+) \|", plan, re.M))
    assert list(rows) == ["setup", *QUICK_STAGES, "total"]
    assert all(int(s) > 0 for s in rows.values())
    assert int(rows["total"]) == sum(int(s) for name, s in rows.items() if name != "total") <= 180
    results = json.loads((out / "gpu_quick.json").read_text())
    assert results["failures"] == []
    assert [e["stage"] for e in results["plan"]] == ["setup", *QUICK_STAGES]
    assert list(results["stages"]) == QUICK_STAGES
    assert all(results["stages"][s]["status"] == "ok" and results["stages"][s]["rows"] for s in QUICK_STAGES)
    [start] = results["stages"]["startup"]["rows"]
    assert "cache.num_blocks" not in start["cache"]  # sized at start-up, as a user's engine is
    decode = [r for r in results["stages"]["decode"]["rows"] if "seqs" in r]
    assert len(decode) == 4 and all(r["ms"] > 0 and r["bucket"] and r["num_splits"] >= 1 for r in decode)
    [serve] = results["stages"]["serve"]["rows"]
    assert serve["out_tok_s"] > 0 and serve["recompiles"] == 0


def quick_module():
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import gpu_quick

    return gpu_quick


def test_a_quick_plan_past_its_budget_is_refused_naming_the_stage_to_cut(monkeypatch, capsys):
    gpu_quick = quick_module()
    plan = [gpu_quick.Estimate("setup", 2, "wheels"), gpu_quick.Estimate("startup", 150, "compiles"),
            gpu_quick.Estimate("serve", 40, "steps")]
    problem = gpu_quick.check_plan(plan, 180)
    assert "192 s on an H200, 12 s past its 180 s budget: cut the serve stage (40 s: steps)" in problem
    assert gpu_quick.check_plan(plan[:2], 180) is None
    monkeypatch.setattr(gpu_quick, "h200_plan", lambda: plan)
    monkeypatch.setattr(sys, "argv", ["gpu_quick.py", "--dry-run", "--out", "unused"])
    with pytest.raises(SystemExit) as exit_info:
        gpu_quick.main()
    assert exit_info.value.code == f"refused: {problem}"  # printed to stderr, exit status 1
    assert "| total | 192 | of the 180 s budget |" in capsys.readouterr().out


def test_the_quick_plans_workload_figures_are_those_of_its_serve_stage():
    """The plan's serve estimate counts the workload's prompt tokens and longest output: they must be
    what the serve stage's config draws."""
    import types

    from jaxcb.benchmark import make_workload
    from jaxcb.config import compose_config

    gpu_quick = quick_module()
    st = types.SimpleNamespace(dry_run=False, check=types.SimpleNamespace(out_dir="unused"))
    cfg = compose_config(gpu_quick.quick_stages.engine_overrides(st))
    items = make_workload(cfg.bench, 128256, 131072)  # llama8b's vocabulary and max_position_embeddings
    assert len(items) == 256
    assert sum(len(w.prompt_token_ids) for w in items) == gpu_quick.WORKLOAD_PROMPT_TOKENS
    assert max(w.output_len for w in items) == gpu_quick.WORKLOAD_LONGEST_OUTPUT


def test_watchdog_writes_the_results_and_exits_inside_a_stage(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run([sys.executable, GPU_CHECK, "--dry-run", "--json", str(out), "--out-dir", str(tmp_path),
                "--stages", "correctness,step", "--budget", "6"], env=clean_env(), timeout=300)
    # No stage before correctness: how long one takes (preflight's imports and ptxas) varies by machine,
    # and correctness in a dry run takes well over 6 s on any of them.
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "WATCHDOG" in proc.stdout
    stages = json.loads(out.read_text())["stages"]
    assert stages["correctness"]["status"] == "timeout"
    assert stages["step"]["status"] == "skipped"
    assert "preflight" not in stages and "engine" not in stages  # not asked for: not reported


def test_rerunning_chosen_stages_keeps_the_others_results(tmp_path):
    out = tmp_path / "gpu.json"
    first = run([sys.executable, GPU_CHECK, "--dry-run", "--json", str(out), "--out-dir", str(tmp_path),
                 "--stages", "preflight,bandwidth"], env=clean_env(), timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = run([sys.executable, GPU_CHECK, "--dry-run", "--json", str(out), "--out-dir", str(tmp_path),
                 "--stages", "smoke"], env=clean_env(), timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    stages = json.loads(out.read_text())["stages"]
    assert [stages[s]["status"] for s in ("preflight", "bandwidth", "smoke")] == ["ok", "ok", "ok"]


def test_without_a_gpu_the_check_stops_after_preflight(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run([sys.executable, GPU_CHECK, "--json", str(out), "--out-dir", str(tmp_path)], env=clean_env(),
               timeout=300)
    assert proc.returncode == 1
    stages = json.loads(out.read_text())["stages"]
    assert stages["preflight"]["status"] == "failed" and "no GPU" in " ".join(stages["preflight"]["errors"])
    assert all(stages[s]["status"] == "skipped" for s in STAGES[1:])


def test_unknown_stage_is_refused_by_name():
    proc = run([sys.executable, GPU_CHECK, "--stages", "smoke,speed"], env=clean_env(), timeout=120)
    assert proc.returncode == 2 and "unknown speed" in proc.stderr


def test_the_bare_venv_and_the_gpu_docs_follow_the_jax_pin():
    """A bump of jax in pyproject.toml must bump the bare venv above and docs/gpu.md with it."""
    import re
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    pins = {re.split(r"[=<>]", d)[0]: d for d in deps if "==" in d}
    for name in ("jax", "jaxlib", "flax", "orbax-checkpoint"):
        assert pins[name] in GPU_IMAGE_PACKAGES, f"{pins[name]} (pyproject.toml) is not in GPU_IMAGE_PACKAGES"
    jax_version = pins["jax"].split("==")[1]
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        cuda = tomllib.load(f)["project"]["optional-dependencies"]["cuda"]
    assert f"jax-cuda13-plugin=={jax_version}" in cuda, f"the cuda extra {cuda} is not jax {jax_version}'s CUDA 13 plugin"
    with open(os.path.join(REPO, "docs", "gpu.md")) as f:
        assert f"jax=={jax_version}" in f.read().replace("`", ""), "docs/gpu.md does not name the pinned jax"
