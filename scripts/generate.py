"""Offline generation: greedy-decode `generate.prompt` with the configured model.

    python scripts/generate.py generate.prompt="Hello" generate.max_tokens=16
    python scripts/generate.py model=hf model.checkpoint=/path/to/llama
"""

import hydra

from jaxcb.cli import entry_point
from jaxcb.config import Config
from jaxcb.offline import generate_one


@hydra.main(version_base=None, config_path="../conf", config_name="config")
@entry_point
def main(cfg: Config) -> None:
    result = generate_one(cfg, cfg.generate.prompt, cfg.generate.max_tokens)
    print(f"prompt: {cfg.generate.prompt!r}")
    print(f"output: {result.text!r}")
    print(f"tokens: {result.token_ids} (finish_reason={result.finish_reason}, {result.tokens_per_s:.1f} tok/s)")


if __name__ == "__main__":
    main()
