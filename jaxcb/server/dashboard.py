"""GET /dashboard: one self-contained page (no build step, no CDN) plotting the engine's own figures.

`DashboardHistory` keeps one sample a second for the last ten minutes -- running and waiting
requests, KV cache usage, tokens/s, TTFT and TPOT percentiles over the last minute, speculative
decoding's acceptance and mean accepted length -- fed
by the engine thread; the page polls /dashboard/data and draws the series on canvases.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from jaxcb.engine_stats import EngineStats
from jaxcb.outputs import RequestOutput

HISTORY_S = 600
LATENCY_WINDOW_S = 60.0


def _pct(values: list[float], q: float):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


class DashboardHistory:
    def __init__(self):
        self._lock = threading.Lock()
        self.samples: deque[dict] = deque(maxlen=HISTORY_S)
        self._ttft: deque[tuple[float, float]] = deque()
        self._tpot: deque[tuple[float, float]] = deque()
        self._tokens: deque[tuple[float, int]] = deque()
        self._last_sample = 0.0
        self._started: set[str] = set()  # requests whose first token was seen (TTFT recorded)

    def on_step(self, stats: EngineStats, outputs: list[RequestOutput], step_seconds: float) -> None:
        """After every step, in the engine thread: `stats` and `outputs` are of the same step."""
        now = time.monotonic()
        with self._lock:
            self._started.difference_update(stats.aborted_request_ids)  # aborted requests send no final output
            self._tokens.append((now, stats.num_tokens))
            for out in outputs:
                m = out.metrics
                # TTFT when the first token comes, not at the end: a stream aborted later still counts.
                if m.first_token_time is not None and out.request_id not in self._started:
                    self._started.add(out.request_id)
                    self._ttft.append((now, m.first_token_time - m.arrival_time))
                if out.finished:
                    self._started.discard(out.request_id)
                if out.finished and m.first_token_time is not None:
                    n = sum(c.num_generated for c in out.outputs)
                    if n > 1 and m.finished_time is not None:
                        self._tpot.append((now, (m.finished_time - m.first_token_time) / (n - 1)))
            if now - self._last_sample >= 1.0:
                self._last_sample = now
                self._sample(stats, now)

    def _sample(self, stats: EngineStats, now: float) -> None:
        for series in (self._ttft, self._tpot, self._tokens):
            while series and series[0][0] < now - LATENCY_WINDOW_S:
                series.popleft()
        recent = [t for ts, t in self._tokens if ts >= now - 5]
        ttft = [v for _, v in self._ttft]
        tpot = [v for _, v in self._tpot]
        self.samples.append({
            "t": time.time(),
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "kv_usage": stats.kv_usage,
            "tokens_per_s": sum(recent) / 5.0,
            "ttft_p50": _pct(ttft, 50), "ttft_p95": _pct(ttft, 95),
            "tpot_p50": _pct(tpot, 50), "tpot_p95": _pct(tpot, 95),
            # speculative decoding (0 / 1 with it off): accepted / proposed tokens, tokens per verify step
            "spec_acceptance": stats.spec_num_accepted_tokens / max(1, stats.spec_num_draft_tokens),
            "spec_mean_accepted_length": stats.spec_mean_accepted_length,
        })

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.samples)


DASHBOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>jaxcb dashboard</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 16px; background: #fafafa; color: #222; }
 h1 { font-size: 18px; margin: 0 0 4px; } #status { color: #666; margin-bottom: 12px; }
 .grid { display: grid; grid-template-columns: repeat(2, minmax(380px, 1fr)); gap: 12px; }
 .panel { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px; }
 .panel h2 { font-size: 14px; margin: 0 0 4px; } canvas { width: 100%; height: 180px; }
 .legend span { margin-right: 12px; } .legend i { display: inline-block; width: 10px; height: 10px; margin-right: 4px; }
</style></head><body>
<h1>jaxcb &mdash; <span id="model">MODEL</span></h1>
<div id="status">waiting for data&hellip;</div>
<div class="grid">
 <div class="panel"><h2>Requests</h2><canvas id="c_requests"></canvas><div class="legend" id="l_requests"></div></div>
 <div class="panel"><h2>KV cache usage (%)</h2><canvas id="c_kv"></canvas><div class="legend" id="l_kv"></div></div>
 <div class="panel"><h2>Tokens / s</h2><canvas id="c_tps"></canvas><div class="legend" id="l_tps"></div></div>
 <div class="panel"><h2>Latency (ms, last minute)</h2><canvas id="c_lat"></canvas><div class="legend" id="l_lat"></div></div>
 <div class="panel"><h2>Speculative decoding (since start-up)</h2><canvas id="c_spec"></canvas><div class="legend" id="l_spec"></div></div>
</div>
<script>
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e"];
function draw(id, samples, series) {
  const canvas = document.getElementById("c_" + id);
  const w = canvas.width = canvas.clientWidth * devicePixelRatio, h = canvas.height = canvas.clientHeight * devicePixelRatio;
  const ctx = canvas.getContext("2d"); ctx.clearRect(0, 0, w, h);
  const pad = 40 * devicePixelRatio;
  let max = 1e-9;
  for (const s of series) for (const p of samples) { const v = s.f(p); if (v != null && v > max) max = v; }
  ctx.strokeStyle = "#ccc"; ctx.fillStyle = "#666"; ctx.font = (11 * devicePixelRatio) + "px sans-serif";
  for (let i = 0; i <= 4; i++) {
    const y = h - pad / 2 - (h - pad) * i / 4;
    ctx.beginPath(); ctx.moveTo(pad, y); ctx.lineTo(w, y); ctx.stroke();
    ctx.fillText((max * i / 4).toPrecision(3), 2, y + 4);
  }
  const t0 = samples.length ? samples[0].t : 0, t1 = samples.length ? samples[samples.length - 1].t : 1;
  series.forEach((s, k) => {
    ctx.strokeStyle = COLORS[k]; ctx.lineWidth = 2 * devicePixelRatio; ctx.beginPath(); let started = false;
    for (const p of samples) {
      const v = s.f(p); if (v == null) continue;
      const x = pad + (w - pad) * (t1 > t0 ? (p.t - t0) / (t1 - t0) : 1), y = h - pad / 2 - (h - pad) * v / max;
      if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
    }
    ctx.stroke();
  });
  document.getElementById("l_" + id).innerHTML = series.map((s, k) => {
    const last = samples.length ? s.f(samples[samples.length - 1]) : null;
    return `<span><i style="background:${COLORS[k]}"></i>${s.name}: ${last == null ? "-" : last.toFixed(2)}</span>`;
  }).join("");
}
const ms = v => v == null ? null : 1000 * v;
async function refresh() {
  try {
    const data = await (await fetch("dashboard/data")).json();
    const s = data.samples;
    document.getElementById("status").textContent =
      `${s.length} samples, last ${s.length ? new Date(1000 * s[s.length - 1].t).toLocaleTimeString() : "-"}`;
    draw("requests", s, [{name: "running", f: p => p.running}, {name: "waiting", f: p => p.waiting}]);
    draw("kv", s, [{name: "used", f: p => 100 * p.kv_usage}]);
    draw("tps", s, [{name: "tokens/s", f: p => p.tokens_per_s}]);
    draw("lat", s, [{name: "TTFT p50", f: p => ms(p.ttft_p50)}, {name: "TTFT p95", f: p => ms(p.ttft_p95)},
                    {name: "TPOT p50", f: p => ms(p.tpot_p50)}, {name: "TPOT p95", f: p => ms(p.tpot_p95)}]);
    draw("spec", s, [{name: "acceptance", f: p => p.spec_acceptance},
                     {name: "mean accepted length", f: p => p.spec_mean_accepted_length}]);
    document.body.dataset.ready = "1";
  } catch (e) { document.getElementById("status").textContent = "error: " + e; }
}
refresh(); setInterval(refresh, 1000);
</script></body></html>
"""


def dashboard_html(model_name: str) -> str:
    return DASHBOARD_HTML.replace("MODEL", model_name)
