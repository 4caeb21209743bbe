#!/usr/bin/env python
"""Follow-up TTFT with and without the prefix cache, full vs POP (`pop_vlm.followup`): a table, the report files and
one final JSON line.

    PYTHONPATH=. python scripts/bench_followup.py --arch qwen3-vl-2b --scale 0.25 --image-sizes 448,1344 \
        --repeats 3 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import sys

from pop_vlm import archs
from pop_vlm.bench import parse_ints
from pop_vlm.cli import parse_prune_layers
from pop_vlm.followup import TURNS, format_table, run_followup, write_outputs  # noqa: F401 - TURNS for callers
from pop_vlm.report import command_line, summary_line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=list(archs.ARCHS), default="qwen3-vl-2b")
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--image-sizes", default="448,1344")
    parser.add_argument("--modes", default="full,pop")
    parser.add_argument("--prune-layers", type=parse_prune_layers, default=1 / 3, help="k or a fraction of L")
    parser.add_argument("--text-tokens", type=int, default=64, help="text tokens of the first question")
    parser.add_argument("--answer-tokens", type=int, default=16, help="tokens generated for the first answer")
    parser.add_argument("--followup-tokens", type=int, default=32, help="tokens of the follow-up question")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--vocab", default="auto")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--out", help="folder for followup-<arch>-s<scale>-cpu.{json,md}")
    parser.add_argument("--notes", default="", help="text appended to the markdown report")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    report = run_followup(
        arch=args.arch, scale=args.scale, image_sizes=parse_ints(args.image_sizes),
        modes=[m for m in args.modes.split(",") if m], prune_layers=args.prune_layers, text_tokens=args.text_tokens,
        answer_tokens=args.answer_tokens, followup_tokens=args.followup_tokens, repeats=args.repeats,
        warmup=args.warmup, vocab=args.vocab, clock=args.clock, log=log)
    report["meta"]["command"] = command_line("scripts/bench_followup.py", argv)
    print(format_table(report))
    if args.out:
        for path in write_outputs(report, args.out, args.notes):
            print(f"wrote {path}", file=sys.stderr)
    print(summary_line(report, "rows"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
