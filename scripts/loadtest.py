#!/usr/bin/env python
"""Load test of a running pop-vlm server on this machine (loopback only), bounded in count and time.

    python scripts/loadtest.py --url http://127.0.0.1:7860 --clients 16 --seconds 120

or start a server on a model for the run itself:

    python scripts/loadtest.py --serve shapes-qwen3-vl --clients 16 --seconds 120 --out benchmarks/results/load
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.loadtest import default_image, run_load  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server on loopback")
    target.add_argument("--serve", metavar="MODEL", help="start a server on this model for the run")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--max-requests", type=int, default=10_000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--no-image", action="store_true", help="text-only requests")
    parser.add_argument("--same-image", action="store_true",
                        help="send one image every time (repeats are then served from the conversation cache)")
    parser.add_argument("--out", help="folder for load.json and load.md")
    args = parser.parse_args()

    image = None if args.no_image else default_image()
    if args.serve:
        from app.models import ModelManager
        from app.server import create_app
        from tests.serving import LoopbackServer

        with LoopbackServer(create_app(ModelManager(args.serve))) as server:
            report = run_load(server.url, args.clients, args.seconds, max_requests=args.max_requests,
                              max_tokens=args.max_tokens, image=image, vary=not args.same_image)
    else:
        report = run_load(args.url, args.clients, args.seconds, max_requests=args.max_requests,
                          max_tokens=args.max_tokens, image=image, vary=not args.same_image)
    print(report.table())
    summary = report.summary()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "load.json").write_text(json.dumps({"command": " ".join(sys.argv), **summary}, indent=2) + "\n")
        (out / "load.md").write_text(f"```\n$ python {' '.join(sys.argv)}\n{report.table()}\n```\n")
    print(json.dumps(summary))
    return 0 if summary["failed"] == 0 and summary["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
