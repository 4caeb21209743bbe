"""Follow-up TTFT: the first question about an image, then a follow-up, with and without the prefix cache.

A real architecture with random weights (`pop_vlm.archs`, optionally width-scaled) is wrapped in a `Pipeline`;
images are synthetic noise run through the model's real image processor (`pop_vlm.bench.Requests`). Each
conversation is synthetic token ids:

    turn 1:    [text head] <vision_start> <image> x n <vision_end> [text tail]          -> answer (A tokens)
    follow-up: turn 1 + answer + [follow-up question (Q tokens)]

For every mode (full, POP with k = L/3 by default) and repeat: the first question (`reuse_prefix=True`, cache
cleared before it, so it starts cold), the follow-up with the prefix cache (only the new tokens are prefilled and
the vision encoder does not run), and the same follow-up prefilled from scratch (`reuse_prefix=False`). The image
processor runs on every request (as `Pipeline.stream_chat` does: the cache is keyed by the image's content), and
its time is the `preproc` column. Modes are interleaved in a rotating order. Times are the engine's `Timings`
(thread CPU time on 1-thread CPU runs, as in `pop-vlm bench`).

    PYTHONPATH=. python scripts/bench_followup.py --arch qwen3-vl-2b --scale 0.25 --image-sizes 448,1344 \
        --repeats 3 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from pop_vlm import archs
from pop_vlm.bench import Point, Requests, clock_timer, parse_ints, resolve_vocab
from pop_vlm.memory import machine_description, tune_malloc
from pop_vlm.config import PopConfig
from pop_vlm.pipeline import Pipeline, resolve_device, resolve_dtype

TURNS = ("first", "follow-up cached", "follow-up scratch")
STAGES = ("preprocess_s", "vision_s", "prefill_s", "first_token_s", "ttft_s")


class IdsTokenizer:
    """Stands in for a tokenizer: the prompts are token ids already; answers decode to their ids."""

    eos_token_id = None
    chat_template = None

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(t)) for t in token_ids)


def parse_prune_layers(text: str):
    value = float(text)
    return int(value) if value >= 1 else value


def run_followup(arch: str = "qwen3-vl-2b", scale: float = 0.25, image_sizes=(448, 1344), modes=("full", "pop"),
                 prune_layers=1 / 3, text_tokens: int = 64, answer_tokens: int = 16, followup_tokens: int = 32,
                 repeats: int = 3, warmup: int = 1, vocab="auto", clock: str = "cpu", log=None) -> dict:
    log = log or (lambda msg: None)
    torch.set_num_threads(1)
    dev = resolve_device("cpu")
    dtype = resolve_dtype("auto", dev)  # fp32 on CPU
    tuned = tune_malloc()
    torch.set_flush_denormal(True)
    if True:
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
            rows += _measure_size(pipe, requests, Point(text_tokens, size), modes, pop, answer_tokens,
                                  followup_tokens, repeats, warmup, log)
    meta = {
        "arch": arch, "hub_id": archs.ARCHS[arch]["hub_id"], "scale": scale, "num_layers": pipe.num_layers,
        "prune_layers": k, "modes": list(modes), "image_sizes": list(image_sizes), "text_tokens": text_tokens,
        "answer_tokens": answer_tokens, "followup_tokens": followup_tokens,
        "parameters": archs.parameter_count(built.model), "device": str(dev), "dtype": str(dtype).split(".")[-1],
        "threads": torch.get_num_threads(), "clock": clock, "repeats": repeats, "warmup": warmup,
        "malloc_tuned": tuned, "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "machine": machine_description(dev), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": None,  # set by main()
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


def format_table(report: dict) -> str:
    meta = report["meta"]
    head = (f"{meta['arch']} ({meta['hub_id']} shape, scale {meta['scale']}, {meta['num_layers']} layers, "
            f"POP k={meta['prune_layers']}, {meta['dtype']}, {meta['device']}, {meta['threads']} thread(s), "
            f"{meta['clock']} clock, {meta['repeats']} repeats; {meta['text_tokens']} text tokens around the image, "
            f"{meta['answer_tokens']}-token answer, {meta['followup_tokens']}-token follow-up; times are medians, ms)")
    cols = (f"{'image':>6}{'vis tok':>8} {'mode':<7}{'turn':<18}{'prompt':>7}{'cached':>7}{'preproc':>8}{'vision':>9}"
            f"{'prefill':>9}{'1st tok':>8}{'TTFT':>9}{'TTFT min':>9}{'cache gain':>11}")
    lines = [head, cols, "-" * len(cols)]
    for r in report["rows"]:
        gain = f"{r['cache_gain']:.1f}x" if r["cache_gain"] else "-"
        lines.append(
            f"{r['image_size']:>6}{r['vision_tokens']:>8} {r['mode']:<7}{r['turn']:<18}{r['prompt_tokens']:>7}"
            f"{r['cached_tokens']:>7}{r['preprocess_s'] * 1e3:>8.1f}{r['vision_s'] * 1e3:>9.1f}{r['prefill_s'] * 1e3:>9.1f}"
            f"{r['first_token_s'] * 1e3:>8.1f}{r['ttft_s'] * 1e3:>9.1f}{r['ttft_min_s'] * 1e3:>9.1f}{gain:>11}")
    lines.append("cached: prompt tokens reused from the prefix cache; cache gain: TTFT of the follow-up prefilled from "
                 "scratch over TTFT with the cache (same mode)")
    return "\n".join(lines)


def summary_line(report: dict) -> str:
    rows = [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in report["rows"]]
    return json.dumps({"meta": report["meta"], "rows": rows})


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
        "| image | vision tokens | mode | turn | prompt tokens | cached | preprocess ms | vision ms | prefill ms | "
        "first token ms | TTFT ms (median) | TTFT ms (min) | cache gain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        gain = f"{r['cache_gain']:.1f}x (min {r['cache_gain_min']:.1f}x)" if r["cache_gain"] else ""
        lines.append(
            f"| {r['image_size']}² | {r['vision_tokens']} | {r['mode']} | {r['turn']} | {r['prompt_tokens']} | "
            f"{r['cached_tokens']} | {r['preprocess_s'] * 1e3:.1f} | {r['vision_s'] * 1e3:.1f} | "
            f"{r['prefill_s'] * 1e3:.1f} | {r['first_token_s'] * 1e3:.1f} | {r['ttft_s'] * 1e3:.1f} | "
            f"{r['ttft_min_s'] * 1e3:.1f} | {gain} |")
    return "\n".join(lines) + "\n"


def write_outputs(report: dict, out, notes: str = "") -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = report["meta"]
    stem = f"followup-{meta['arch']}-s{meta['scale']}-{meta['device'].split(':')[0]}"
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    md_path.write_text(markdown(report) + (("\n" + notes.strip() + "\n") if notes.strip() else ""))
    return [json_path, md_path]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=list(archs.ARCHS), default="qwen3-vl-2b")
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--image-sizes", default="448,1344")
    parser.add_argument("--modes", default="full,pop")
    parser.add_argument("--prune-layers", type=parse_prune_layers, default=1 / 3, help="k or a fraction of L")
    parser.add_argument("--text-tokens", type=int, default=64, help="text tokens of the first question")
    parser.add_argument("--answer-tokens", type=int, default=16, help="tokens generated for the first answer")
    parser.add_argument("--followup-tokens", type=int, default=32, help="tokens of the follow-up question")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--vocab", default="auto")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--out", help="folder for followup-<arch>-s<scale>-cpu.{json,md}")
    parser.add_argument("--notes", default="", help="text appended to the markdown report")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    report = run_followup(
        arch=args.arch, scale=args.scale, image_sizes=parse_ints(args.image_sizes),
        modes=[m for m in args.modes.split(",") if m], prune_layers=args.prune_layers, text_tokens=args.text_tokens,
        answer_tokens=args.answer_tokens, followup_tokens=args.followup_tokens, repeats=args.repeats,
        warmup=args.warmup, vocab=args.vocab, clock=args.clock, log=log)
    report["meta"]["command"] = "PYTHONPATH=. python scripts/bench_followup.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    print(format_table(report))
    if args.out:
        for path in write_outputs(report, args.out, args.notes):
            print(f"wrote {path}", file=sys.stderr)
    print(summary_line(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
