#!/usr/bin/env python
"""Serving benchmark: serial vs continuously batched `pop-vlm serve`, full vs POP, 1 to 32 streaming clients.

For each model, each server (a process of its own on loopback) is warmed up, then measured at each client count
in each mode: requests/s, generated tokens/s, TTFT and inter-token latency p50/p99 at the client, rows per
batched decode step at the server; batched answers are checked against the serial ones. Writes serving.json,
serving.md and serving.png to --out and ends with one JSON line.

    PYTHONPATH=. python scripts/bench_serving.py --out benchmarks/results/serving
    PYTHONPATH=. python scripts/bench_serving.py --models gemma-3-270m --clients 1,16 --seconds 20
    PYTHONPATH=. python scripts/bench_serving.py --device cuda --dtype bf16 --threads 0 --clients 1,4,16,32 \\
        --out benchmarks/results/gpu/serving
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.serving_report import format_table, write_outputs  # noqa: E402
from app.serving_suite import WORKLOADS, SuiteConfig, run_suite  # noqa: E402
from pop_vlm.report import command_line, summary_line  # noqa: E402

KEYS = ("model", "server", "mode", "clients", "sent", "completed", "cancelled", "failed", "lost", "wrong_length",
        "requests_per_s", "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "ttft_lower_bound", "itl_p50_s", "itl_p99_s",
        "chunk_per_token", "rows_per_step", "compared", "mismatches")


def main() -> int:
    defaults = SuiteConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(defaults.models), help=f"of {', '.join(WORKLOADS)}")
    parser.add_argument("--clients", default=",".join(map(str, defaults.clients)))
    parser.add_argument("--modes", default=",".join(defaults.modes))
    parser.add_argument("--servers", default=",".join(defaults.kinds), help="serial, batched")
    parser.add_argument("--per-client", type=int, default=defaults.per_client,
                        help="requests each client sends at most, back to back")
    parser.add_argument("--seconds", type=float, default=defaults.seconds,
                        help="no request is sent after this; requests not yet admitted then are cancelled")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help="the batched server's --max-batch-size (default: the most clients)")
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--threads", type=int, default=defaults.threads, help="server's torch threads (0: torch's choice)")
    parser.add_argument("--out", help="folder for serving.json, serving.md and serving.png")
    args = parser.parse_args()

    config = SuiteConfig(models=tuple(_names(args.models)), kinds=tuple(_names(args.servers)),
                         modes=tuple(_names(args.modes)), clients=tuple(int(c) for c in _names(args.clients)),
                         per_client=args.per_client, seconds=args.seconds, batch_size=args.batch_size,
                         device=args.device, dtype=args.dtype, threads=args.threads or None)
    unknown = [m for m in config.models if m not in WORKLOADS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    report = run_suite(config, log=lambda line: print(line, file=sys.stderr, flush=True))
    report["meta"]["command"] = command_line("scripts/bench_serving.py")
    print(format_table(report))
    if args.out:
        for path in write_outputs(report, args.out):
            print(f"wrote {path}", file=sys.stderr)
    print(summary_line(report, "rows", KEYS))
    rows = report["rows"]
    return 0 if not any(r["failed"] or r["lost"] or r["wrong_length"] for r in rows) else 1


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


if __name__ == "__main__":
    sys.exit(main())
