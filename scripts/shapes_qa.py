#!/usr/bin/env python
"""Exact-match accuracy and median TTFT of a shapes demo model on the 600 held-out questions, per mode.

Each record's inputs are built once and every mode answers them in turn (alternating order), warm, on one CPU
thread by default, read with the thread's CPU clock (time-slicing by other processes is not counted):

    python scripts/shapes_qa.py --model shapes-gemma-3 --k 6 --modes full pop static --out benchmarks/results

`--card` writes the figures into the model card's "Full, POP and static prefill" section, with the accuracy on the
first `--check` records, which `tests/test_shapes_qa.py` checks.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import pop_vlm  # noqa: E402
from pop_vlm import report, shapes, zoo  # noqa: E402
from pop_vlm.bench import environment, use_thread_clock  # noqa: E402
from pop_vlm.evaluate import shapes_qa_report  # noqa: E402
from pop_vlm.train.card import MODES_TITLE, modes_section, with_section  # noqa: E402
from pop_vlm.train.data import load_jsonl, shapes_test_path  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="shapes-gemma-3", help="zoo name or model folder")
    parser.add_argument("--k", type=int, default=None, help="layers pruned in prefill (default L/3)")
    parser.add_argument("--modes", nargs="+", default=["full", "pop", "static"])
    parser.add_argument("--limit", type=int, default=None, help="only the first N records")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="folder for <name>-shapes-qa.json")
    parser.add_argument("--check", type=int, default=100,
                        help="also report the accuracy on the first N records (the check set of the tests)")
    parser.add_argument("--card", action="store_true", help="write the figures into the model folder's model card")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = pop_vlm.load(args.model, device="cpu")
    clock = use_thread_clock(pipe, args.threads)
    pipe.warm_up()
    records = load_jsonl(shapes_test_path())[: args.limit]
    result = shapes_qa_report(pipe, records, modes=args.modes, prune_layers=args.k, progress=True,
                              check=min(args.check, len(records)))
    result.update(command=report.command_line("scripts/shapes_qa.py"), threads=args.threads, clock=clock,
                  environment=environment(pipe.device))
    if "full" in result["ttft_median_s"] and "pop" in result["ttft_median_s"]:
        result["ttft_speedup"] = result["ttft_median_s"]["full"] / result["ttft_median_s"]["pop"]
    for mode in args.modes:
        accuracy = result["accuracy"][mode]
        types = "  ".join(f"{t}={accuracy.get('type:' + t, float('nan')):.3f}" for t in shapes.QTYPES)
        print(f"{mode:>7}  all={accuracy['all']:.3f}  {types}  ttft median={result['ttft_median_s'][mode] * 1e3:.1f} ms")
    if args.card:
        card = Path(zoo.resolve(args.model)) / "model_card.md"
        card.write_text(with_section(card.read_text(encoding="utf-8"), MODES_TITLE, modes_section(result)),
                        encoding="utf-8")
        print(f"wrote the figures into {card}")
    if args.out:
        out = Path(args.out) / f"{Path(args.model).name}-shapes-qa.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("model", "n", "k", "num_layers", "ttft_median_s") if k in result}
                     | {"all": {m: result["accuracy"][m]["all"] for m in args.modes},
                        "ttft_speedup": result.get("ttft_speedup")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
