"""The public API is four names on the package, and importing the host-side config imports no jax."""

import subprocess
import sys


def test_the_package_exports_llm_engine_sampling_and_beam_search_params():
    import jaxcb
    from jaxcb.beam_search import BeamSearchParams
    from jaxcb.engine import LLM, Engine
    from jaxcb.sampling_params import SamplingParams

    assert (jaxcb.LLM, jaxcb.Engine, jaxcb.SamplingParams, jaxcb.BeamSearchParams) == (
        LLM, Engine, SamplingParams, BeamSearchParams)
    assert sorted(jaxcb.__all__) == ["BeamSearchParams", "Engine", "LLM", "SamplingParams"]


def test_importing_the_package_and_its_config_imports_no_jax():
    code = "import sys, jaxcb, jaxcb.config, jaxcb.core.scheduler, jaxcb.output; print('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
