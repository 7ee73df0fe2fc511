"""Convert a Hugging Face Llama checkpoint directory into an Orbax one that jaxcb loads directly.

    python scripts/convert_checkpoint.py /path/to/Llama-3.1-8B /path/to/llama8b-orbax --dtype bfloat16
    python scripts/serve.py model=hf model.checkpoint=/path/to/llama8b-orbax

The output holds params/ (Orbax) and copies of config.json and the tokenizer files.
"""

import argparse
import sys

from jaxcb.config import ConfigError, ModelConfig, validate_model_config
from jaxcb.model.loader import CheckpointError, convert_hf_to_orbax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", help="HF checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("out_dir", help="new directory for the Orbax checkpoint")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    m = ModelConfig(name="hf", checkpoint=args.hf_dir, init="checkpoint", dtype=args.dtype)
    try:
        validate_model_config(m)
        out = convert_hf_to_orbax(m, args.out_dir)
    except (ConfigError, CheckpointError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
