"""`tokenmill convert GGUF_FILE OUT_DIR`: turn a GGUF model into a safetensors checkpoint directory."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert a GGUF file into a safetensors checkpoint directory",
        description="Dequantize a GGUF model (Llama, Qwen2, Qwen3) with transformers' GGUF reader and "
        "write OUT_DIR with config.json, generation_config.json, safetensors weights and the tokenizer "
        "(with its chat template), ready for --model. Works offline.",
    )
    parser.add_argument("gguf_file", metavar="GGUF_FILE", help="the .gguf file")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to create")
    parser.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16", "float16"),
                        help="dtype of the written weights (default float32, also for auto: dequantized "
                        "values kept exactly)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is not empty")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tokenmill.engine.convert import ConvertError, convert_gguf

    try:
        # TOKENMILL_DTYPE is shared with the serving commands, where "auto" is common.
        dtype = "float32" if args.dtype == "auto" else args.dtype
        out = convert_gguf(args.gguf_file, args.out_dir, dtype=dtype, overwrite=args.overwrite)
    except ConvertError as exc:
        print(f"tokenmill convert: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
