"""The Hydra entry points: they run on the tiny model and turn bad configuration into one clear line."""

import os
import subprocess
import sys

from hf_checkpoints import make_hf_llama, write_word_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Few step buckets: each script run compiles every one (the CPU defaults have seven up to 32 tokens).
SMALL = ("scheduler.max_num_batched_tokens=32", "scheduler.max_num_seqs=4", "engine.max_model_len=128",
         "engine.token_buckets=[16]")


def run_script(script, *overrides, cwd=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", script), *overrides, "hydra.run.dir=" + (cwd or "/tmp/jaxcb-test-runs")],
        capture_output=True, text=True, timeout=300, env=env,
    )


def test_generate_greedy_decodes_with_the_tiny_model(tmp_path):
    proc = run_script("generate.py", "generate.prompts=[Hello,World]", "generate.max_tokens=5", *SMALL, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "prompt: 'Hello'" in proc.stdout and "prompt: 'World'" in proc.stdout
    assert proc.stdout.count("finish_reason=length") == 2


def test_generate_matches_one_sequence_greedy_decoding(tmp_path):

    from jaxcb.config import compose_config
    from jaxcb.model.loader import load_model
    from benchmarks.reference_generate import greedy_generate
    from jaxcb.tokenizer import ByteTokenizer

    model, _ = load_model(compose_config().model)
    expected = greedy_generate(model, ByteTokenizer().encode("Hello"), 5).token_ids
    proc = run_script("generate.py", "generate.prompts=[Hello]", "generate.max_tokens=5", *SMALL, cwd=str(tmp_path))
    assert f"tokens: {expected}" in proc.stdout, proc.stdout


def test_generate_from_an_hf_checkpoint_uses_its_tokenizer(tmp_path):
    ckpt = tmp_path / "ckpt"
    make_hf_llama(str(ckpt))
    write_word_tokenizer(str(ckpt), 131)
    proc = run_script(
        "generate.py", "model=hf", f"model.checkpoint={ckpt}", "model.dtype=float32",
        "generate.prompts=['w5 w6 w7']", "generate.max_tokens=4", *SMALL, cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    assert "tokenizer HFTokenizer" in proc.stdout + proc.stderr


def test_config_error_is_one_sentence_and_exit_code_2(tmp_path):
    proc = run_script("generate.py", "model=llama8b", cwd=str(tmp_path))
    assert proc.returncode == 2
    assert "error: model=llama8b has no weights: add model.checkpoint=DIR" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_key_typo_fails_before_anything_runs_as_one_sentence_and_exit_code_2(tmp_path):
    proc = run_script("serve.py", "scheduler.max_num_seq=4", cwd=str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: scheduler.max_num_seq is not a config field jaxcb knows (did you mean scheduler.max_num_seqs?); "
        "the fields are listed in conf/scheduler/")
    assert "HYDRA_FULL_ERROR" not in proc.stderr and "+scheduler" not in proc.stderr


def test_prompt_longer_than_max_model_len_is_refused(tmp_path):
    proc = run_script(
        "generate.py", "engine.max_model_len=64", "generate.prompts=[" + "a" * 60 + "]", "generate.max_tokens=8",
        "scheduler.max_num_batched_tokens=32", "scheduler.max_num_seqs=4", "engine.token_buckets=[16]", cwd=str(tmp_path),
    )
    assert proc.returncode == 2
    assert "exceeds engine.max_model_len=64" in proc.stderr


def test_serve_starts_the_http_server_and_exits_0_on_sigterm(tmp_path):
    import signal
    import time

    import httpx

    from server_harness import free_port

    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "scripts", "serve.py"), f"server.port={port}", *SMALL,
         "server.shutdown_timeout_s=5", f"hydra.run.dir={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # A stream in flight when SIGTERM arrives is allowed to finish (shutdown_timeout_s=5).
        lines = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "Hello", "max_tokens": 60, "ignore_eos": True, "stream": True,
        }) as stream:
            it = stream.iter_lines()
            lines.append(next(it))
            proc.send_signal(signal.SIGTERM)
            lines.extend(it)
        assert lines[-1] == "data: [DONE]" or lines[-1] == "" and "data: [DONE]" in lines
        assert proc.wait(timeout=60) == 0
        assert f"serving tiny on http://127.0.0.1:{port} (ready)" in proc.stdout.read()  # once it answers
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_engine_watch_stops_the_server_once_the_engine_dies_and_not_before():
    """serve() exits 1 after it (server.exit_on_engine_death): a supervisor restarts what would answer only 503s."""
    import threading
    import time
    from types import SimpleNamespace

    from jaxcb.server.run import watch_engine

    alive = [False]  # the server not started yet: its lifespan starts the engine
    server, died = SimpleNamespace(should_exit=False, started=False), threading.Event()
    thread = watch_engine(server, lambda: alive[0], died, interval_s=0.01)
    time.sleep(0.05)
    server.started = True  # an engine that died before any check saw it alive counts too
    thread.join(timeout=5)
    assert server.should_exit and died.is_set()
    server, died = SimpleNamespace(should_exit=True, started=True), threading.Event()  # a SIGTERM's stop: nothing
    watch_engine(server, lambda: False, died, interval_s=0.01).join(timeout=5)
    assert not died.is_set()
    # Ray: a replica restarting (no replica alive for a while) is not a dead engine, one gone for grace_s is
    server, died = SimpleNamespace(should_exit=False, started=True), threading.Event()
    alive[0] = False
    thread = watch_engine(server, lambda: alive[0], died, interval_s=0.01, grace_s=0.3)
    time.sleep(0.1)
    alive[0] = True
    time.sleep(0.4)
    assert not died.is_set()
    alive[0] = False
    thread.join(timeout=5)
    assert died.is_set()
