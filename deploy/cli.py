"""The `raydix` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raydix", description="raydix LLM inference cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="serve a model over OpenAI-compatible HTTP")
    args = parser.parse_args(argv)
    if args.command == "serve":
        print(
            "raydix serve: the HTTP server is not built yet; this release ships the KV cache "
            "manager (raydix.cache) only.",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
