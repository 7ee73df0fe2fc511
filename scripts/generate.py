"""Offline generation: a JSONL job, or `generate.prompts`, with the configured model.

    python scripts/generate.py input=prompts.jsonl output=results.jsonl   # crash-safe; rerun to resume
    python scripts/generate.py input=batch.jsonl output=out.jsonl   # an OpenAI batch file (vLLM run_batch format)
    python scripts/generate.py input=prompts.jsonl output=results.jsonl job.backend=ray job.num_replicas=4   # jaxcb[dist]
    python scripts/generate.py
    python scripts/generate.py 'generate.prompts=[Hello,"Once upon a time"]' generate.max_tokens=16
    python scripts/generate.py model=hf model.checkpoint=/path/to/llama generate.temperature=0.8 generate.seed=0
"""

import hydra

from jaxcb.cli import checked_overrides, entry_point
from jaxcb.config import Config
from jaxcb.jobs import generate_prompts, run_job


@checked_overrides
@hydra.main(version_base=None, config_path="../conf", config_name="config")
@entry_point
def main(cfg: Config) -> None:
    if cfg.input is not None:
        job = run_job(cfg, cfg.input, cfg.output)
        print(
            f"{job.num_input} records: {job.num_skipped} already done, {job.num_done} generated, "
            f"{job.num_errors} errors; {job.output_tokens} tokens in {job.seconds:.1f} s -> {cfg.output}"
        )
        return
    report = generate_prompts(cfg, list(cfg.generate.prompts))
    for out in report.outputs:
        c = out.outputs[0]
        print(f"prompt: {out.prompt!r}")
        print(f"output: {c.text!r}")
        print(f"tokens: {c.token_ids} (finish_reason={c.finish_reason})")
    print(f"{report.num_output_tokens} tokens in {report.seconds:.2f} s ({report.num_output_tokens / report.seconds:.1f} tok/s)")


if __name__ == "__main__":
    main()
