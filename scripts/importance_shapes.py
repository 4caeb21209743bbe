#!/usr/bin/env python
"""The shipped layer-importance profile of a bundled shapes demo model (written into its folder).

Calibration: fresh shapes-task scenes (seeds 800,000,000 + i: the training range, disjoint from the test set),
one question each, with labels sampled from the model (virtual-gate Fisher importance, `Pipeline.importance`).

    python scripts/importance_shapes.py --samples 48 --draws 4
    python scripts/importance_shapes.py --model shapes-gemma-3
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import pop_vlm  # noqa: E402
from pop_vlm import plots, shapes, zoo  # noqa: E402

QTYPES = ["color_of_shape", "shape_of_color", "count", "exists", "left_right"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="shapes-qwen3-vl")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--draws", type=int, default=4, help="label draws per sample")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot", default=None, help="default: benchmarks/results/<model name>-importance.png")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = pop_vlm.load(args.model, device="cpu")
    records = shapes.make_records(range(800_000_000, 800_000_000 + args.samples), QTYPES)
    samples = [shapes.sample_from_record(r) for r in records]
    profile = pipe.importance(samples, samples_per_prompt=args.draws, progress=True)
    out = Path(zoo.resolve(args.model)) / "importance.json"
    profile.to_json(out)
    plot = args.plot or f"benchmarks/results/{Path(args.model).name}-importance.png"
    plots.importance_profile(profile, plot)
    for row in profile.as_table():
        print(f"layer {row['layer']}: prefill {row['prefill_share']:.4f}  decode {row['decode_share']:.4f}  "
              f"BI {row['block_influence']:.3f}")
    print(f"auto k = {profile.auto_k()}; wrote {out} and {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
