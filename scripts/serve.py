"""The OpenAI-compatible server.

    python scripts/serve.py                                                  # tiny model, 127.0.0.1:8000
    python scripts/serve.py model=llama8b model.checkpoint=/path/to/Llama-3.1-8B scheduler.max_num_seqs=128
    python scripts/serve.py server.port=9000 server.api_key=secret
    python scripts/serve.py server.backend=ray server.num_replicas=2      # 2 engines on Ray, one endpoint (jaxcb[dist])

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus). SIGTERM stops admitting, lets in-flight requests finish for
server.shutdown_timeout_s, aborts the rest and exits 0.
"""

import hydra

from jaxcb.cli import checked_overrides, entry_point
from jaxcb.config import Config
from jaxcb.server.run import serve


@checked_overrides
@hydra.main(version_base=None, config_path="../conf", config_name="config")
@entry_point
def main(cfg: Config) -> None:
    serve(cfg)


if __name__ == "__main__":
    main()
