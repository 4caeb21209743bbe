"""Export of a trained demo model: `save_pretrained` weights and processor, chat template, training curve
(`training_curve.json` and `.png`) and model card, written to a temporary folder and swapped in at once.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..plots import training_curve
from .card import model_card


def export(family, model, config, processor, args, info: dict, curve: list, test_report: dict | None) -> float:
    """Write `model` (the best weights, loaded) to ``args.export_dir`` (atomically replaced); returns the weights'
    size in MB."""
    out = Path(args.export_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if args.export_dtype == "bf16":
        model = model.to(torch.bfloat16)
    model.generation_config = family.generation_config(processor.tokenizer)
    model.save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)
    with open(tmp / "chat_template.jinja", "w", encoding="utf-8") as handle:
        handle.write(family.CHAT_TEMPLATE)
    size_mb = sum(f.stat().st_size for f in tmp.glob("*.safetensors")) / 1e6
    info = dict(info, size_mb=round(size_mb, 2))
    with open(tmp / "training_curve.json", "w", encoding="utf-8") as handle:
        json.dump({"info": info, "curve": curve}, handle, indent=1)
    training_curve(curve, tmp / "training_curve.png")
    with open(tmp / "model_card.md", "w", encoding="utf-8") as handle:
        handle.write(model_card(family, config, processor, args, info, test_report))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return size_mb


def trained_state(model) -> dict:
    """The model's state without its frozen parameters (a pretrained language model is not saved again)."""
    return {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()
            if not (isinstance(v, torch.nn.Parameter) and not v.requires_grad)}


def load_trained(model, state: dict):
    """Load a `trained_state` into a fresh model: only its frozen parameters may be missing."""
    frozen = set(model.state_dict()) - set(trained_state(model))
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - frozen:
        raise ValueError(f"state does not fit the model: missing {sorted(set(result.missing_keys) - frozen)[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
