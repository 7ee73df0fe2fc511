"""Run a test file in a subprocess whose JAX sees several fake CPU devices.

JAX fixes its device count when it first starts, and the rest of the suite runs with one
CPU device; multi-device tests (tests/multi_device/, not collected by a plain `pytest`)
therefore run in a fresh interpreter with `--xla_force_host_platform_device_count`.
"""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tests_on_fake_devices(path: str, num_devices: int = 8, timeout_s: int = 600, select: str = ""
                              ) -> subprocess.CompletedProcess:
    """`pytest path` (relative to the repository) with `num_devices` CPU devices, only the tests `select`
    picks where given (pytest's -k); its output in .stdout."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_devices}".strip(),
        PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-x", "-p", "no:cacheprovider", os.path.join(REPO, path),
         *(["-k", select] if select else [])],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


def assert_all_passed(proc: subprocess.CompletedProcess) -> None:
    """Every test of the subprocess ran and passed (a skip means it did not see its devices)."""
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    ok = proc.returncode == 0 and " passed" in summary and "skipped" not in summary
    assert ok, f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
