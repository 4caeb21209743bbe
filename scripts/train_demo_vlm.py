#!/usr/bin/env python
"""Train a bundled demo VLM from scratch on the synthetic shapes task: a thin command over `pop_vlm.train`.

Seeded and resumable from the checkpoint in ``--out-dir`` (default ``<cache>/train/<model name>/``, ``<cache>`` as
`pop_vlm.zoo.cache_dir` says); the best model on a held-out set is exported to ``assets/models/<model name>/``.

Usage::

    python scripts/train_demo_vlm.py --minutes 150 --threads 1
    python scripts/train_demo_vlm.py --family gemma3 --threads 1 --minutes 600 --image-size 128 --patch-size 8 \
        --image-tokens 64 --vision-width 192 --vision-layers 4 --total-steps 4000 --eval-every 20 --val-size 200 \
        --export-every 30 --export-dir <cache>/train/shapes-gemma-3/export
    python scripts/train_demo_vlm.py --family gemma3 --ship <cache>/train/shapes-gemma-3/export

``--ship`` trains nothing: it turns a whole export (the full model, as `save_pretrained` writes it) of a model
trained around a frozen pretrained language model into the shipped form (``--export-dir``, default
``assets/models/<model name>/``): the trained weights only, the language model joined to them at load.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pop_vlm.train import options, ship, train  # noqa: E402


def main(argv=None):
    args = options.parse_args(argv, description=__doc__)
    if args.ship:
        size_mb = ship(args)
        print(f"shipped {args.ship} as {size_mb:.1f} MB of trained weights")
        return
    command = "python scripts/train_demo_vlm.py " + " ".join(sys.argv[1:] if argv is None else argv)
    train(args, command)


if __name__ == "__main__":
    main()
