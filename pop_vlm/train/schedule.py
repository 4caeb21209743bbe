"""The learning rate of a training run: linear warm-up, cosine decay, and a short climb back after a start from an
export's weights."""
from __future__ import annotations

import math

#: steps over which the learning rate climbs back after a start from an export's weights: its AdamW moments start
#: at zero, which makes the first updates full-size steps in the sign of the gradient
REWARM_STEPS = 25


def lr_at(step: int, args) -> float:
    """The learning rate at `step`: linear warm-up over `--warmup-steps`, then cosine decay to `--min-lr-ratio`."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.total_steps - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def rewarm_factor(state: dict) -> float:
    """1, except in the first `REWARM_STEPS` steps after a start from an export (`Trainer.start_from_export`)."""
    start = state.get("rewarm_from")
    return 1.0 if start is None else min(1.0, (state["step"] - start + 1) / REWARM_STEPS)
