"""The model card (`model_card.md`) written beside an exported demo model.

The task, data, training and accuracy sections are shared; the family builder writes the introduction, the
"Model" section and the loading lines of "Use".
"""
from __future__ import annotations

import re

from .. import shapes as S
from .data import TRAIN_SEED_LIMIT, VAL_SEED_START


def model_card(family, config, processor, args, info: dict, test_report: dict | None) -> str:
    lines = [f"# {family.MODEL_NAME}", "", *family.card_intro(), ""]
    lines += task_section() + data_section(args)
    lines += ["## Model", "", *family.card_model(config, processor, args, info), ""]
    lines += training_section(family, args, info)
    if test_report:
        lines += accuracy_section(test_report)
    lines += use_section(family)
    return "\n".join(lines)


def task_section() -> list[str]:
    return [
        "## Task",
        "",
        "Canvases of 224-896 px per side (white, light grey or light noise background) with 1-4 non-overlapping",
        "circles, squares and triangles in six colours, small (10-15% of the shorter side) or large (25-35%).",
        "Questions (one-word answers): `What color is the {shape}?`, `What shape is the {color} object?`,",
        "`How many shapes are there?`, `Is there a {color} {shape}?`, `Is the {color} {shape} on the left or",
        "the right?`. Scoring: exact match after lower-casing and removing spaces and punctuation.",
        "",
    ]


def data_section(args) -> list[str]:
    return [
        "## Data",
        "",
        f"Scenes are generated on the fly (training seeds < {TRAIN_SEED_LIMIT:,}; model selection on "
        f"{args.val_size} held-out scenes with seeds from {VAL_SEED_START:,}; the test set "
        "`assets/qa/shapes_test.jsonl` uses seeds >= 1,000,000,000). Curriculum: first up to 2 mostly large",
        f"objects ({args.stage1_images:,} images), then up to 3 ({args.stage2_images:,}), then the full task. "
        f"{args.questions_per_image} questions per image.",
        "",
    ]


def training_section(family, args, info: dict) -> list[str]:
    return [
        "## Training",
        "",
        "```",
        info["command"],
        "```",
        "",
        *runs_lines(info.get("runs", [])),
        f"Trained on {info['device']} ({info['threads']} thread(s)) for {info['total_minutes']:.0f} minutes and "
        f"{info['total_images']:,} images by the time of this export. The exported weights are those with the best "
        f"held-out accuracy ({info['val_accuracy']:.3f}), reached at step {info['step']:,} after {info['images']:,} "
        f"images and {info['train_minutes']:.0f} minutes of training.",
        f"Loss: cross-entropy on the answer token and `{family.EOS_TOKEN}` only, plus two auxiliary losses whose small",
        "heads are not exported: per merged vision token, the colour and shape of the object under it (or",
        "background) and its canvas half, from the vision features; and at each colour or shape word of a",
        "question, the number, side, colour and shape of the objects the phrase so far refers to, from the",
        f"output of text layer {args.word_layer}.",
        "AdamW, linear warm-up then cosine decay. `training_curve.json` holds the loss and held-out",
        "accuracy over training.",
        "",
    ]


def runs_lines(runs: list[dict]) -> list[str]:
    """The runs that trained the model when it took more than one (each resumed from the one before)."""
    if len(runs) < 2 and not (runs and runs[0]["step"] > 0):
        return []
    lines = ["Training ran in several runs, each resumed from the checkpoint of the one before:", ""]
    if runs[0]["step"] > 0:
        lines.append(f"* steps 0-{runs[0]['step']:,}: the runs before are in the training log (`train.log`)")
    for run, after in zip(runs, runs[1:] + [None]):
        span = f"from step {run['step']:,}" if after is None else f"steps {run['step']:,}-{after['step']:,}"
        lines.append(f"* {span}: `{run['command']}`")
    return lines + [""]


def accuracy_section(report: dict) -> list[str]:
    lines = [
        f"## Accuracy on `assets/qa/shapes_test.jsonl` ({report['n']} questions, greedy)",
        "",
        f"Overall: **{report['accuracy']:.3f}**",
        "",
        "| question type | n | accuracy |",
        "|---|---|---|",
    ]
    for q, acc in report["by_qtype"].items():
        lines.append(f"| {q} | {report['n_by_qtype'][q]} | {acc:.3f} |")
    lines += ["", "By canvas size (rows: height, columns: width):", ""]
    lines.append("| h \\ w | " + " | ".join(str(w) for w in S.CANVAS_SIZES) + " | all |")
    lines.append("|---" * (len(S.CANVAS_SIZES) + 2) + "|")
    for h in S.CANVAS_SIZES:
        cells = [report["by_canvas"].get(f"{w}x{h}", float("nan")) for w in S.CANVAS_SIZES]
        lines.append(
            f"| {h} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {report['by_height'].get(h, float('nan')):.2f} |"
        )
    lines.append(
        "| all | " + " | ".join(f"{report['by_width'].get(w, float('nan')):.2f}" for w in S.CANVAS_SIZES) + " | |"
    )
    lines.append("")
    return lines


def use_section(family) -> list[str]:
    return [
        "## Use",
        "",
        "```python",
        *family.card_use(),
        "image, question, answer = shapes.sample_from_record(record)  # a line of shapes_test.jsonl",
        'messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]',
        "text = processor.apply_chat_template(messages, add_generation_prompt=True)",
        'inputs = processor(text=[text], images=[image], return_tensors="pt")',
        "out = model.generate(**inputs, max_new_tokens=4, do_sample=False)",
        'pred = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)',
        "```",
        "",
    ]


# ---- measured after training: the prefill modes on the test set ---------------------------------------------------
MODES_TITLE = "## Full, POP and static prefill on the test set"


def modes_section(report: dict) -> list[str]:
    """Accuracy and median TTFT of each prefill mode (a `scripts/shapes_qa.py` report), and the accuracy on the
    first records, which `tests/test_shapes_qa.py` checks (a model too slow for the whole set on CI is checked on
    those)."""
    modes = list(report["ttft_median_s"])
    env = report.get("environment", {})
    lines = [
        MODES_TITLE,
        "",
        f"k = {report['k']} of {report['num_layers']} layers pruned in prefill; greedy, one-word answers, exact match.",
        f"Measured with `{report['command']}` on {env.get('machine', 'this machine')} "
        f"({report['threads']} thread(s), torch {env.get('torch', '?')}, {env.get('date', report.get('date', '?'))}).",
        f"TTFT: vision encoder, prefill and first token (each record's inputs built once beforehand), warm, median over the "
        f"{report['n']} records ({report['clock']}); the modes answer each record in turn, in "
        "alternating order, so they see the same inputs and machine state.",
        "",
        "| mode | accuracy | TTFT median (ms) | TTFT vs full |",
        "|---|---|---|---|",
    ]
    full_ttft = report["ttft_median_s"].get("full")
    for mode in modes:
        ttft = report["ttft_median_s"][mode]
        ratio = f"{full_ttft / ttft:.2f}x" if full_ttft else ""
        lines.append(f"| {mode} | {report['accuracy'][mode]['all']:.3f} | {ttft * 1e3:.1f} | {ratio} |")
    check = report.get("check")
    if check:
        figures = ", ".join(f"{mode} **{check['accuracy'][mode]:.3f}**" for mode in modes)
        lines += ["", f"Check set: the first {check['n']} records: {figures}."]
    return lines + [""]


def check_figures(card_text: str) -> dict | None:
    """The check set of a model card's modes section: {"n": records, "k": layers pruned, "accuracy": {mode: acc}},
    and the accuracy of each mode on the whole test set, from the section's table ("whole": {mode: acc})."""
    if MODES_TITLE not in card_text:
        return None
    section = card_text.split(MODES_TITLE, 1)[1].split("\n## ", 1)[0]
    k = re.search(r"k = (\d+) of \d+ layers", section)
    check = re.search(r"Check set: the first (\d+) records: (.*)\.", section)
    if not (k and check):
        return None
    accuracy = {mode: float(acc) for mode, acc in re.findall(r"(\w[\w-]*) \*\*([0-9.]+)\*\*", check.group(2))}
    whole = {mode: float(acc) for mode, acc in re.findall(r"^\| (\w[\w-]*) \| ([0-9.]+) \|", section, re.MULTILINE)}
    return {"n": int(check.group(1)), "k": int(k.group(1)), "accuracy": accuracy, "whole": whole}


def with_section(card_text: str, title: str, lines: list[str]) -> str:
    """The card with the section `title` replaced by `lines` (added before "## Use" when it has none)."""
    body = "\n".join(lines).rstrip("\n") + "\n\n"
    if title in card_text:
        head, rest = card_text.split(title, 1)
        tail = rest.split("\n## ", 1)
        return head + body + ("## " + tail[1] if len(tail) > 1 else "")
    if "## Use\n" in card_text:
        head, rest = card_text.split("## Use\n", 1)
        return head + body + "## Use\n" + rest
    return card_text.rstrip("\n") + "\n\n" + body
