"""scripts/gpu_check.py runs end to end on the CPU (--dry-run), so the GPU script cannot rot."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_dry_run_passes_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "gpu_check.py"), "--dry-run", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ALL CHECKS PASSED" in proc.stdout
    results = json.loads(out.read_text())
    assert results["failures"] == []
    assert {r["impl"] for r in results["correctness"]} == {"pallas", "xla"}
    assert len(results["decode_attention"]) == 8 and len(results["full_step"]) == 3
