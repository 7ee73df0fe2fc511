"""The OpenAI-compatible server entry point.

    python scripts/serve.py model=llama8b model.checkpoint=/path/to/Llama-3.1-8B scheduler.max_num_seqs=128

The HTTP server is not built yet: for now this validates the configuration, loads the
model and runs one short offline generation, so that the command is already the one
that will serve.
"""

import logging

import hydra

from jaxcb.cli import entry_point
from jaxcb.config import Config
from jaxcb.offline import generate_one

log = logging.getLogger("jaxcb.serve")


@hydra.main(version_base=None, config_path="../conf", config_name="config")
@entry_point
def main(cfg: Config) -> None:
    print(
        f"jaxcb: the HTTP server is not available yet; would listen on {cfg.server.host}:{cfg.server.port}. "
        f"Running a short offline generation on model={cfg.model.name} instead."
    )
    result = generate_one(cfg, cfg.generate.prompt, cfg.generate.max_tokens)
    print(f"prompt: {cfg.generate.prompt!r}")
    print(f"output: {result.text!r} ({len(result.token_ids)} tokens, finish_reason={result.finish_reason})")


if __name__ == "__main__":
    main()
