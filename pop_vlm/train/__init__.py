"""Training of the bundled demo VLMs on the synthetic shapes task (`pop_vlm.shapes`), from scratch, on CPU or CUDA.

`data` (scenes, batches, curriculum, held-out sets), one builder per model family (`families`), `heads` (training
probes), `lora` (low-rank adapters on a frozen pretrained language model), `loop` (seeded, resumable training),
`export` and `card` (model card); the curve is drawn by
`pop_vlm.plots`, and `options` is the command line of `scripts/train_demo_vlm.py`. A family's demo model is one
more builder file and its line in `FAMILIES`.
"""
from __future__ import annotations

from .families import FAMILIES, family  # noqa: F401 - the package's public names


def train(args, command: str | None = None) -> dict:
    """Run training as `options.parse_args` describes it; returns the final training state."""
    from .loop import Trainer

    return Trainer(args, command).run()


def ship(args) -> float:
    """Turn the whole export ``args.ship`` into the shipped form in ``args.export_dir`` (default: the bundled
    model's folder); returns the weights' size in MB."""
    from .. import zoo
    from .export import ship_export

    builder = family(args.family)
    return ship_export(builder, args.ship, args.export_dir or zoo.bundled_path(builder.MODEL_NAME))
