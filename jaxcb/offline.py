"""Offline generation of the configured prompts through the engine (scripts/generate.py, scripts/serve.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from jaxcb.cli import UserError
from jaxcb.config import Config
from jaxcb.engine import LLM
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import InvalidRequestError, SamplingParams


@dataclass
class GenerationReport:
    outputs: list[RequestOutput]
    seconds: float

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for o in self.outputs for c in o.outputs)


def generate_prompts(cfg: Config, prompts: list[str]) -> GenerationReport:
    g = cfg.generate
    try:
        params = SamplingParams(max_tokens=g.max_tokens, temperature=g.temperature, top_p=g.top_p, seed=g.seed)
        llm = LLM(cfg)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
    except InvalidRequestError as e:
        raise UserError(str(e)) from e
    return GenerationReport(outputs, time.perf_counter() - start)
