"""Export of a trained demo model: weights and processor, chat template, training curve (`training_curve.json` and
`.png`) and model card, written to a temporary folder and swapped in at once.

A model trained whole is written by `save_pretrained`. One trained around a frozen pretrained language model (its
builder's `PRETRAINED`) is shipped small: the trained weights only, and `base_model.json` naming the language model
that `pop_vlm.load` joins to them (`pop_vlm.assembly`), with the low-rank adapters trained on it (`lora`), if
any, in `adapters.safetensors`, and without the tokenizer when the pretrained model's gives it back.
`ship_export` turns a whole export of such a model (without adapters) into that form.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .. import assembly
from ..plots import training_curve
from . import lora
from .card import model_card, use_section, with_section


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
    pretrained = getattr(family, "PRETRAINED", None)
    if pretrained:
        adapters = lora.settings_of(model)
        base = assembly.base_description(**pretrained, adapters=adapters and adapters.description())
        assembly.save_shipped(model, trained_state(model), tmp, base)
    else:
        model.save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)
    with open(tmp / "chat_template.jinja", "w", encoding="utf-8") as handle:
        handle.write(family.CHAT_TEMPLATE)
    if pretrained:
        assembly.leave_out_tokenizer(tmp)
    size_mb = sum(f.stat().st_size for f in tmp.glob("*.safetensors")) / 1e6
    info = dict(info, size_mb=round(size_mb, 2))
    if adapter_params := lora.count(model):
        info["adapter_params"] = adapter_params
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
    """Load a `trained_state` into a fresh model: only its frozen parameters may be missing, and its adapters when
    the state has none (a state from before they were added: they keep their start, the pretrained function); every
    tensor must have the model's shape."""
    own = model.state_dict()
    if reshaped := [f"{name} is {tuple(tensor.shape)} in the state, {tuple(own[name].shape)} in the model"
                    for name, tensor in state.items() if name in own and tensor.shape != own[name].shape]:
        raise ValueError(f"state does not fit the model: {'; '.join(reshaped[:5])}")
    may_miss = set(own) - set(trained_state(model))
    adapters = {name for name in own if lora.is_adapter(name)}
    if not any(name in state for name in adapters):
        may_miss |= adapters
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - may_miss:
        raise ValueError(f"state does not fit the model: missing {sorted(set(result.missing_keys) - may_miss)[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")


def ship_export(family, full_dir, out_dir) -> float:
    """Turn a whole export (`save_pretrained` of the full model) of `family`'s demo model into the shipped form in
    `out_dir` (atomically replaced; it may be `full_dir`): the trained weights only, the training curve's size and
    the model card's "Use" section brought up to date. Returns the weights' size in MB."""
    pretrained = getattr(family, "PRETRAINED", None)
    if not pretrained:
        raise ValueError(f"{family.MODEL_NAME} is trained whole: its export is already the shipped form")
    out = Path(out_dir)
    staging = out.with_name(out.name + ".ship")
    assembly.shrink(full_dir, staging, **pretrained)
    size_mb = sum(f.stat().st_size for f in staging.glob("*.safetensors")) / 1e6
    curve_file = staging / "training_curve.json"
    if curve_file.is_file():
        record = json.loads(curve_file.read_text(encoding="utf-8"))
        record.setdefault("info", {})["size_mb"] = round(size_mb, 2)
        curve_file.write_text(json.dumps(record, indent=1), encoding="utf-8")
    card = staging / "model_card.md"
    if card.is_file():  # the loading lines of a whole export do not load the shipped form
        use = use_section(family)
        card.write_text(with_section(card.read_text(encoding="utf-8"), use[0], use), encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    os.replace(staging, out)
    return size_mb
