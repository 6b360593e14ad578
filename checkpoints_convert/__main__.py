"""`python -m checkpoints_convert SRC OUT`: HF safetensors dir, GGUF file or z-lab DFlash drafter dir ->
bastion_jax checkpoint."""

from __future__ import annotations

import sys
import time

from bastion_jax.cli import Parser


def main(argv: list[str] | None = None) -> int:
    p = Parser(
        prog="python -m checkpoints_convert",
        description="Convert a Hugging Face safetensors directory (sharded or not), a GGUF file or a z-lab "
                    "DFlash drafter directory into an orbax checkpoint + config.json (+ the tokenizer, for a "
                    "target) that bastion_jax loads.")
    p.add_argument("src", help="HF model directory (config.json + *.safetensors), a .gguf file or a z-lab DFlash "
                   "drafter directory")
    p.add_argument("out", help="output directory (created; must be empty if it exists)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="parameter dtype to store (default: bfloat16)")
    args = p.parse_args(argv)

    from bastion_jax.checkpoints.convert import convert
    from bastion_jax.checkpoints.errors import ConversionError

    t0 = time.perf_counter()
    try:
        out = convert(args.src, args.out, args.dtype)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"converted {args.src} -> {out} ({args.dtype}) in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
