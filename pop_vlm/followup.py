"""Follow-up TTFT: the first question about an image, then a follow-up, with and without the prefix cache.

A real architecture with random weights (`pop_vlm.archs`, optionally width-scaled) is wrapped in a `Pipeline`;
images are synthetic noise run through the model's real image processor (`pop_vlm.bench.Requests`). Each
conversation is synthetic token ids: turn 1 is [text head] <image tokens> [text tail] and its answer (A tokens); the
follow-up is turn 1 + answer + [follow-up question (Q tokens)]. For every mode and repeat: the first question (cache
cleared before it), the follow-up with the prefix cache (only the new tokens are prefilled; the vision encoder does
not run), and the same follow-up prefilled from scratch. `scripts/bench_followup.py` is its command line.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from . import archs
from .bench import Point, Requests, clock_timer, denormals_flushed, environment, resolve_vocab
from .config import PopConfig
from .memory import tune_malloc
from .loading import resolve_device, resolve_dtype
from .pipeline import Pipeline
from .report import Column, markdown_table, ms, text_table, write_json

TURNS = ("first", "follow-up cached", "follow-up scratch")
STAGES = ("preprocess_s", "vision_s", "prefill_s", "first_token_s", "ttft_s")


class IdsTokenizer:
    """Stands in for a tokenizer: the prompts are token ids already; answers decode to their ids."""

    eos_token_id = None
    chat_template = None

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(t)) for t in token_ids)


def run_followup(arch: str = "qwen3-vl-2b", scale: float = 0.25, image_sizes=(448, 1344), modes=("full", "pop"),
                 prune_layers=1 / 3, text_tokens: int = 64, answer_tokens: int = 16, followup_tokens: int = 32,
                 repeats: int = 3, warmup: int = 1, vocab="auto", clock: str = "cpu", log=None) -> dict:
    """Measure every (image size, mode, turn); {"meta": ..., "rows": [...]}."""
    log = log or (lambda msg: None)
    torch.set_num_threads(1)
    dev = resolve_device("cpu")
    dtype = resolve_dtype("auto", dev)  # fp32 on CPU
    tuned = tune_malloc()
    start = time.perf_counter()
    built = archs.build(arch, scale=scale, vocab=resolve_vocab(vocab, scale), dtype=dtype, device=dev)
    if not built.is_multimodal:
        raise ValueError(f"{arch} is a text model: the follow-up benchmark needs a VLM")
    log(f"built {arch} at scale {scale} ({archs.parameter_count(built.model) / 1e6:.1f} M parameters) "
        f"in {time.perf_counter() - start:.1f}s")
    pipe = Pipeline(built.model, IdsTokenizer(), name=arch)
    pipe.timer = clock_timer(clock)
    pipe.eos_token_ids = set()  # random weights: every answer runs to answer_tokens
    pop = PopConfig(prune_layers=prune_layers)
    k = pop.num_pruned(pipe.num_layers)
    requests = Requests(built, dev)
    rows = []
    for size in image_sizes:
        with denormals_flushed():
            rows += _measure_size(pipe, requests, Point(text_tokens, size), modes, pop, answer_tokens,
                                  followup_tokens, repeats, warmup, log)
    meta = {
        "arch": arch, "hub_id": archs.ARCHS[arch]["hub_id"], "scale": scale, "num_layers": pipe.num_layers,
        "prune_layers": k, "modes": list(modes), "image_sizes": list(image_sizes), "text_tokens": text_tokens,
        "answer_tokens": answer_tokens, "followup_tokens": followup_tokens,
        "parameters": archs.parameter_count(built.model), "device": str(dev), "dtype": str(dtype).split(".")[-1],
        "threads": torch.get_num_threads(), "clock": clock, "repeats": repeats, "warmup": warmup,
        "malloc_tuned": tuned, **environment(dev),
        "command": None,  # set by the command that ran it
        "cache_gain": "median TTFT of the follow-up prefilled from scratch / median TTFT of the follow-up with the cache",
    }
    return {"meta": meta, "rows": rows}


def _request(pipe, requests, point, ids, mode, pop, max_new_tokens, reuse):
    start = pipe.timer()
    inputs = requests.make(point)  # runs the image processor, as every chat turn does
    inputs["input_ids"] = torch.tensor([ids], dtype=torch.long)
    preprocess = pipe.timer() - start
    return pipe.generate(inputs, mode=mode, pop=pop, max_new_tokens=max_new_tokens, reuse_prefix=reuse,
                         preprocess_s=preprocess)


def _conversation(pipe, requests, point, first_ids, followup_question, mode, pop, answer_tokens):
    """One conversation: the first question, then the follow-up with the cache and from scratch."""
    pipe.prefix_cache.clear()
    first = _request(pipe, requests, point, first_ids, mode, pop, answer_tokens, True)
    followup_ids = first_ids + first.token_ids + followup_question
    cached = _request(pipe, requests, point, followup_ids, mode, pop, 1, True)
    scratch = _request(pipe, requests, point, followup_ids, mode, pop, 1, False)
    pipe.prefix_cache.clear()
    return {"first": first, "follow-up cached": cached, "follow-up scratch": scratch}


def _measure_size(pipe, requests, point, modes, pop, answer_tokens, followup_tokens, repeats, warmup, log):
    log(f"image {point.image_size}px, {point.text_tokens} text tokens")
    first_ids = requests.make(point)["input_ids"][0].tolist()
    followup_question = requests.text_ids(followup_tokens)
    for _ in range(warmup):
        for mode in modes:
            _conversation(pipe, requests, point, first_ids, followup_question, mode, pop, answer_tokens)
    answers = {(mode, turn): [] for mode in modes for turn in TURNS}
    for r in range(repeats):
        order = list(modes[r % len(modes):]) + list(modes[: r % len(modes)])
        for mode in order:
            for turn, answer in _conversation(pipe, requests, point, first_ids, followup_question, mode, pop,
                                              answer_tokens).items():
                answers[mode, turn].append(answer)
        log(f"  repeat {r + 1}/{repeats}: " + "  ".join(
            f"{m} {answers[m, 'first'][-1].timings.ttft_s:.2f}/{answers[m, 'follow-up cached'][-1].timings.ttft_s:.2f}/"
            f"{answers[m, 'follow-up scratch'][-1].timings.ttft_s:.2f}s" for m in modes))
    rows = []
    for mode in modes:
        scratch_ttft = statistics.median(a.timings.ttft_s for a in answers[mode, "follow-up scratch"])
        scratch_min = min(a.timings.ttft_s for a in answers[mode, "follow-up scratch"])
        full_first = statistics.median(a.timings.ttft_s for a in answers[modes[0], "first"])
        for turn in TURNS:
            group = answers[mode, turn]
            row = {"image_size": point.image_size, "mode": mode, "turn": turn,
                   "k": len(group[0].pruned_layers), "prompt_tokens": group[0].n_prompt_tokens,
                   "vision_tokens": group[0].n_image_tokens, "cached_tokens": group[0].timings.n_cached_tokens,
                   "repeats": len(group)}
            for stage in STAGES:
                values = [getattr(a.timings, stage) for a in group]
                row[stage] = statistics.median(values)
                row[stage.replace("_s", "_min_s")] = min(values)
            row["cache_gain"] = scratch_ttft / row["ttft_s"] if turn == "follow-up cached" else None
            row["cache_gain_min"] = scratch_min / row["ttft_min_s"] if turn == "follow-up cached" else None
            row["ttft_vs_full_first"] = full_first / row["ttft_s"]
            rows.append(row)
    return rows


def _gain(row: dict, with_min: bool = False) -> str:
    if not row["cache_gain"]:
        return "" if with_min else "-"
    return f"{row['cache_gain']:.1f}x" + (f" (min {row['cache_gain_min']:.1f}x)" if with_min else "")


def columns(markdown: bool = False) -> tuple[Column, ...]:
    """The report's columns, for the text table and (`markdown`) the markdown one."""
    return (
        Column("image", lambda r: f"{r['image_size']}²" if markdown else r["image_size"], 5),
        Column("vision tokens" if markdown else "vis tok", lambda r: r["vision_tokens"], 7),
        Column("mode", lambda r: r["mode"], 6, left=True), Column("turn", lambda r: r["turn"], 17, left=True),
        Column("prompt tokens" if markdown else "prompt", lambda r: r["prompt_tokens"], 6),
        Column("cached", lambda r: r["cached_tokens"], 6),
        Column("preprocess ms" if markdown else "preproc", ms("preprocess_s"), 7),
        Column("vision ms" if markdown else "vision", ms("vision_s"), 8),
        Column("prefill ms" if markdown else "prefill", ms("prefill_s"), 8),
        Column("first token ms" if markdown else "1st tok", ms("first_token_s"), 7),
        Column("TTFT ms (median)" if markdown else "TTFT", ms("ttft_s"), 8),
        Column("TTFT ms (min)" if markdown else "TTFT min", ms("ttft_min_s"), 8),
        Column("cache gain", lambda r: _gain(r, with_min=markdown), 10),
    )


def format_table(report: dict) -> str:
    meta = report["meta"]
    head = (f"{meta['arch']} ({meta['hub_id']} shape, scale {meta['scale']}, {meta['num_layers']} layers, "
            f"POP k={meta['prune_layers']}, {meta['dtype']}, {meta['device']}, {meta['threads']} thread(s), "
            f"{meta['clock']} clock, {meta['repeats']} repeats; {meta['text_tokens']} text tokens around the image, "
            f"{meta['answer_tokens']}-token answer, {meta['followup_tokens']}-token follow-up; times are medians, ms)")
    return "\n".join([head, *text_table(columns(), report["rows"]),
                      "cached: prompt tokens reused from the prefix cache; cache gain: TTFT of the follow-up prefilled "
                      "from scratch over TTFT with the cache (same mode)"])


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        f"# Follow-up TTFT with the prefix cache: {meta['arch']} at scale {meta['scale']}, CPU",
        "",
        f"- command: `{meta['command'] or 'scripts/bench_followup.py'}`",
        f"- machine: {meta['machine']}; torch {meta['torch']}, transformers {meta['transformers']}; "
        f"{meta['threads']} thread, {meta['clock']} clock (thread CPU time), glibc malloc tuned: {meta['malloc_tuned']}",
        f"- date: {meta['date']}",
        f"- model: {meta['hub_id']} architecture, random weights, width scale {meta['scale']} "
        f"({meta['parameters'] / 1e6:.1f} M parameters, {meta['num_layers']} layers), {meta['dtype']}; "
        f"POP prunes k = {meta['prune_layers']} layers (L/3)",
        f"- conversation: {meta['text_tokens']} random text tokens around one synthetic image; the first answer is "
        f"{meta['answer_tokens']} generated tokens; the follow-up question is {meta['followup_tokens']} more tokens",
        f"- {meta['repeats']} timed repeats after {meta['warmup']} warm-up, modes interleaved; medians and minimums",
        "",
        *markdown_table(columns(markdown=True), report["rows"]),
    ]
    return "\n".join(lines) + "\n"


def write_outputs(report: dict, out, notes: str = "") -> list[Path]:
    meta = report["meta"]
    stem = f"followup-{meta['arch']}-s{meta['scale']}-{meta['device'].split(':')[0]}"
    json_path = write_json(report, Path(out) / f"{stem}.json")
    md_path = Path(out) / f"{stem}.md"
    md_path.write_text(markdown(report) + (("\n" + notes.strip() + "\n") if notes.strip() else ""))
    return [json_path, md_path]
