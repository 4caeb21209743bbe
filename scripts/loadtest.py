#!/usr/bin/env python
"""Load test of a running pop-vlm server on this machine (loopback only), bounded in count and time.

    python scripts/loadtest.py --url http://127.0.0.1:7860 --clients 16 --seconds 120

or start a server on a model for the run itself — one process, or Ray Serve replicas (needs the ray extra) — with
web-page sessions clicking "compare" alongside the API clients:

    python scripts/loadtest.py --serve shapes-qwen3-vl --clients 16 --seconds 120 --out benchmarks/results/load
    python scripts/loadtest.py --serve shapes-qwen3-vl --ray 2 --clients 4 --pages 4 --seconds 60
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
    parser.add_argument("--clients", type=int, default=8, help="API clients")
    parser.add_argument("--pages", type=int, default=0, help="web-page sessions clicking 'compare' meanwhile")
    parser.add_argument("--ray", type=int, metavar="N", help="with --serve: serve from N Ray Serve replicas")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--max-requests", type=int, default=10_000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--no-image", action="store_true", help="text-only requests")
    parser.add_argument("--same-image", action="store_true",
                        help="send one image every time (repeats are then served from the conversation cache)")
    parser.add_argument("--out", help="folder for load.json and load.md")
    args = parser.parse_args()

    image = None if args.no_image else default_image()
    if args.ray and not args.serve:
        parser.error("--ray starts the replicas itself: use it with --serve MODEL")
    load = dict(max_requests=args.max_requests, max_tokens=args.max_tokens, image=image, vary=not args.same_image,
                pages=args.pages)
    if args.serve and args.ray:
        report = run_on_ray(args.serve, args.ray, args.clients, args.seconds, load)
    elif args.serve:
        from app.models import ModelManager
        from app.server import create_app
        from tests.serving import LoopbackServer

        with LoopbackServer(create_app(ModelManager(args.serve))) as server:
            report = run_load(server.url, args.clients, args.seconds, **load)
    else:
        report = run_load(args.url, args.clients, args.seconds, **load)
    print(report.table())
    summary = report.summary()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        where = machine()
        (out / "load.json").write_text(json.dumps({"command": " ".join(sys.argv), **where, **summary}, indent=2) + "\n")
        (out / "load.md").write_text(f"{where['date']}, {where['machine']}\n\n"
                                     f"```\n$ python {' '.join(sys.argv)}\n{report.table()}\n```\n")
    print(json.dumps(summary))
    return 0 if summary["failed"] == 0 and summary["lost"] == 0 else 1


def machine() -> dict:
    import datetime
    import os
    import platform

    import torch

    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"}


def run_on_ray(model: str, replicas: int, clients: int, seconds: float, load: dict):
    """Start a local Ray with `replicas` CPU replicas of `model` on a free port, run the load, shut it down."""
    import ray
    from ray import serve

    from app import ray_serve
    from tests.serving import free_port

    ray_serve.init_local_ray(log_to_driver=False)
    port = free_port()
    try:
        ray_serve.start({"model": model, "replicas": replicas, "num_cpus": 0}, host="127.0.0.1", port=port)
        ray_serve.wait_for_replicas(replicas, timeout_s=300)
        return run_load(f"http://127.0.0.1:{port}", clients, seconds, **load)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
