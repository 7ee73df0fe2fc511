"""scripts/load_test.py against a real server: a short, small load with no errors."""

import json
import os
import subprocess
import sys

from server_harness import running_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_load_test_reports_zero_errors_and_latency_percentiles(tmp_path):
    with running_server() as (url, _):
        out = tmp_path / "load.json"
        proc = subprocess.run(
            [sys.executable, os.path.join(REPO, "scripts", "load_test.py"), "--url", url, "--concurrency", "8",
             "--duration", "3", "--prompt-len", "4", "16", "--output-len", "4", "16", "--json", str(out)],
            capture_output=True, text=True, timeout=120,
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["errors"] == 0 and result["requests"] > 0 and result["output_tokens_per_s"] > 0
    assert set(result["ttft_ms"]) == {"p50", "p95", "p99"}


def test_load_test_refuses_a_non_loopback_target():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "load_test.py"), "--url", "http://10.1.2.3:8000", "--duration", "1"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0 and "loopback" in proc.stderr
