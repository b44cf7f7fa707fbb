"""Command line: ``nemo-moe-export verify DIR [--reference REF]``.

The Hydra recipe main job (``nemo-moe-export recipe=...``) arrives with the recipe issue; the
``verify`` subcommand is dispatched before it and needs no config.
"""

from __future__ import annotations

import argparse
import sys


def verify_main(argv: list[str]) -> int:
    from nemo_moe_export.export.verify import verify_checkpoint

    parser = argparse.ArgumentParser(prog="nemo-moe-export verify",
                                     description="Check an HF safetensors checkpoint from its bytes.")
    parser.add_argument("path", help="checkpoint directory")
    parser.add_argument("--reference", help="checkpoint directory to compare every tensor with")
    args = parser.parse_args(argv)
    report = verify_checkpoint(args.path, reference=args.reference)
    print(report.summary())
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "verify":
        return verify_main(argv[1:])
    print("usage: nemo-moe-export verify DIR [--reference REF]\n"
          "(the recipe main job arrives with the recipe issue)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
