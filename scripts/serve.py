"""The OpenAI-compatible server entry point.

    python scripts/serve.py model=llama8b model.checkpoint=/path/to/Llama-3.1-8B scheduler.max_num_seqs=128

The HTTP server is not built yet: for now this validates the configuration, starts the
engine and runs `generate.prompts` as one offline batch, so that the command is already
the one that will serve.
"""

import hydra

from jaxcb.cli import entry_point
from jaxcb.config import Config
from jaxcb.offline import generate_prompts


@hydra.main(version_base=None, config_path="../conf", config_name="config")
@entry_point
def main(cfg: Config) -> None:
    print(
        f"jaxcb: the HTTP server is not available yet; would listen on {cfg.server.host}:{cfg.server.port}. "
        f"Running the engine on generate.prompts offline instead (model={cfg.model.name})."
    )
    report = generate_prompts(cfg, list(cfg.generate.prompts))
    for out in report.outputs:
        c = out.outputs[0]
        print(f"{out.prompt!r} -> {c.text!r} ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")


if __name__ == "__main__":
    main()
