"""GET /dashboard in a real headless browser (Debian's chromium), with a screenshot kept as an artifact.

CI installs chromium and sets JAXCB_REQUIRE_BROWSER=1, so there the browser test cannot be
skipped; on a machine without chromium it is skipped with the reason.
"""

import os
import shutil
import subprocess
import tempfile
import time

import httpx
import pytest

from server_harness import running_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(REPO, "outputs", "test-artifacts")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def make_traffic(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=60) as http:
        while time.monotonic() < deadline:
            http.post(url + "/v1/completions", json={"model": "tiny", "prompt": "load", "max_tokens": 32, "temperature": 0.7})


def test_dashboard_data_has_a_sample_a_second():
    with running_server() as (url, _):
        make_traffic(url, 2.5)
        data = httpx.get(url + "/dashboard/data").json()
        page = httpx.get(url + "/dashboard")
    assert page.status_code == 200 and "<canvas" in page.text and "<script src" not in page.text  # self-contained
    samples = data["samples"]
    assert data["model"] == "tiny" and len(samples) >= 2
    assert set(samples[-1]) >= {"running", "waiting", "kv_usage", "tokens_per_s", "ttft_p50", "ttft_p95", "tpot_p50"}
    assert any(s["tokens_per_s"] > 0 for s in samples)


def chromium(*args: str) -> subprocess.CompletedProcess:
    profile = tempfile.mkdtemp(prefix="jaxcb-chromium-")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--window-size=1200,800", "--virtual-time-budget=4000"]
    try:
        return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("JAXCB_REQUIRE_BROWSER"),
                    reason="chromium is not installed (CI installs it: apt-get install chromium)")
def test_dashboard_renders_in_headless_chromium(tmp_path):
    assert CHROMIUM is not None, "JAXCB_REQUIRE_BROWSER is set but chromium is not installed"
    with running_server() as (url, _):
        make_traffic(url, 2.5)
        dom = chromium("--dump-dom", url + "/dashboard")
        shot = tmp_path / "dashboard.png"
        chromium(f"--screenshot={shot}", url + "/dashboard")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-ready="1"' in dom.stdout, "the page never drew the engine's data"
    assert "running:" in dom.stdout and "TTFT p50:" in dom.stdout and "samples, last" in dom.stdout
    assert shot.exists() and shot.stat().st_size > 10_000  # a rendered page, not a blank one
    os.makedirs(ARTIFACTS, exist_ok=True)
    shutil.copy(shot, os.path.join(ARTIFACTS, "dashboard.png"))


def test_dashboard_ttft_counts_a_stream_at_its_first_token_even_if_it_is_aborted_later():
    from jaxcb.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from jaxcb.server.dashboard import DashboardHistory

    from jaxcb.engine_stats import EMPTY_STEP, EngineStats

    def stats(aborted=()):
        return EngineStats(**{**EMPTY_STEP, "num_tokens": 1}, num_running=0, num_waiting=0, num_swapped=0,
                           num_waiting_tokens=0, kv_usage=0.0, host_kv_usage=0.0, num_steps=1, num_preemptions=0,
                           prefix_cache_queries=0, prefix_cache_hits=0, num_recompiles=0,
                           aborted_request_ids=aborted)

    history = DashboardHistory()
    started = time.monotonic()
    first = RequestOutput("a", None, [1], [CompletionOutput(0, "x", [5], num_generated=1)], False,
                          RequestMetrics(started - 0.25, started - 0.2, started), delta=True)
    history.on_step(stats(), [first], 0.01)
    history.on_step(stats(), [first], 0.01)  # a later delta of the same request is not counted again
    history._last_sample = 0.0  # the next step takes a sample (one a second)
    history.on_step(stats(aborted=("a",)), [], 0.01)  # aborted: no final output ever comes
    [sample] = history.snapshot()[-1:]
    assert sample["ttft_p50"] == pytest.approx(0.25)
    assert history._started == set()
