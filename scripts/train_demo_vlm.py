#!/usr/bin/env python
"""Train a bundled demo VLM from scratch on the synthetic shapes task (`pop_vlm.train`).

Today's family is Qwen3-VL (`--family qwen3-vl`, the `shapes-qwen3-vl` model). Training is seeded and resumable:
a checkpoint is written every few minutes to ``<cache>/train/<model name>/`` (``<cache>``: ``$POP_VLM_CACHE``,
else ``$XDG_CACHE_HOME/pop-vlm``, else ``$HF_HOME/pop-vlm``, else ``~/.cache/pop-vlm``) and picked up again by
the next run with the same output folder. The best model so far on a held-out set is exported every
``--export-every`` minutes to ``assets/models/<model name>/`` with its model card and training curve.

Usage::

    python scripts/train_demo_vlm.py --minutes 150 --threads 1
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pop_vlm.train import options, train  # noqa: E402


def main(argv=None):
    args = options.parse_args(argv, description=__doc__)
    command = "python scripts/train_demo_vlm.py " + " ".join(sys.argv[1:] if argv is None else argv)
    train(args, command)


if __name__ == "__main__":
    main()
