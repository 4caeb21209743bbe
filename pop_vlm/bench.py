"""TTFT benchmark: full vs POP vs static over prompt lengths and image sizes, against the FLOP limit.

Models are the real architectures of `pop_vlm.archs` with random weights (optionally width-scaled); prompts are
synthetic token ids, and images synthetic noise run through the model's real image processor. Every request goes
through `generate_tokens` (the engine's one generation loop) with one new token, so the timings are the engine's
own `Timings`: preprocessing (image processor, prompt ids), vision encoder, LM prefill, first token (POP: the
boundary step). Modes are interleaved within each repeat, in a rotating order, so drift hits all of them alike;
speedups are ratios of medians (and of minimums) measured in the same run.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import archs, plots
from .config import MODES, PopConfig
from .families import adapter_class_for, detect_family
from .flops import DecoderShape, flop_limit, prefill_flops
from .generate import GenerationResult, generate_tokens
from .results import Timings
from .memory import PeakWatcher, machine_description, tune_malloc
from .report import Column, ms, text_table, write_json
from .report import summary_line as report_summary_line


@dataclass
class BenchConfig:
    """One benchmark run; the command line's defaults are these."""

    arch: str = "qwen3-vl-2b"
    scale: float = 1.0  # width scale in (0, 1]: layers, layer types and head_dim are kept
    tokens: tuple[int, ...] = (32, 128, 512, 1024, 2048, 4096)  # text prompt lengths
    image_sizes: tuple[int, ...] = (448, 896, 1344, 1792)  # square image sides (VLMs), each with image_text_tokens
    image_text_tokens: int = 64
    modes: tuple[str, ...] = MODES
    prune_layers: int | float | str = 1 / 3
    repeats: int = 3
    warmup: int = 1
    threads: int | None = None  # torch threads (None: torch's choice)
    device: str = "auto"
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    vocab: int | str | None = "auto"  # auto: the real vocabulary at scale 1, 16384 entries when scaled
    clock: str = "auto"  # cpu: the thread's CPU time (1-thread CPU runs); wall: wall clock (synchronised on CUDA)
    malloc_tuning: bool = True

    def resolved_clock(self, device: torch.device) -> str:
        clock = self.clock
        if clock == "auto":
            clock = auto_clock(device, torch.get_num_threads())
        if clock not in ("cpu", "wall"):
            raise ValueError(f"--clock must be auto, cpu or wall, not {clock!r}")
        if clock == "cpu" and auto_clock(device, torch.get_num_threads()) != "cpu":
            raise ValueError("--clock cpu measures the calling thread: only for --device cpu --threads 1")
        return clock


@contextmanager
def denormals_flushed():
    """Subnormal floats flushed to zero while measuring (random weights make some, and x86 computes with them
    slowly); the setting is the processor's, for the whole process, so the default is restored after."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def auto_clock(device: torch.device, threads: int | None) -> str:
    """"cpu" on one CPU thread: that thread's CPU time leaves out other processes' time slices; "wall" otherwise,
    since one thread's CPU time misses the work of other threads and of a GPU."""
    return "cpu" if device.type == "cpu" and threads == 1 else "wall"


def clock_timer(clock: str):
    """The function that reads a clock named by `BenchConfig.resolved_clock`."""
    return time.thread_time if clock == "cpu" else time.perf_counter


CLOCK_NAMES = {"cpu": "thread CPU time", "wall": "wall clock"}


def use_thread_clock(pipe, threads: int | None) -> str:
    """Point `pipe.timer` at the thread's CPU clock when `pipe` runs on `threads` == 1 CPU thread, else at the
    wall clock (`auto_clock`); returns the clock's name for the record."""
    clock = auto_clock(pipe.device, threads)
    pipe.timer = clock_timer(clock)
    return CLOCK_NAMES[clock]


# ---- synthetic requests --------------------------------------------------------------------------------------
@dataclass
class Point:
    text_tokens: int
    image_size: int = 0  # 0: text only


class Requests:
    """Builds the processor-like inputs of a benchmark point; `make()` is what preprocessing times."""

    def __init__(self, built: archs.Built, device: torch.device, seed: int = 0):
        self.built = built
        self.device = device
        self.rng = np.random.default_rng(seed)
        self.vocab_text = built.vocab_size - 16  # the top ids of a shrunk vocabulary are special tokens
        self.family = adapter_class_for(built.architecture)
        self.image_processor = self.family.bench_image_processor(built.model) if built.is_multimodal else None
        self._images: dict[int, object] = {}

    def image(self, size: int):
        from PIL import Image

        if size not in self._images:
            pixels = self.rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
            self._images[size] = Image.fromarray(pixels)
        return self._images[size]

    def text_ids(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab_text, size=n).tolist()

    def make(self, point: Point) -> dict:
        special, text = self.built.special, self.text_ids(max(2, point.text_tokens))
        head, tail = text[: len(text) // 2], text[len(text) // 2:]
        inputs: dict = {}
        pixels = None
        if point.image_size and self.image_processor is not None:
            pixels = self.image_processor(images=[self.image(point.image_size)], return_tensors="pt")
            inputs.update({k: v for k, v in pixels.items() if k != "pixel_values"})
            inputs["pixel_values"] = pixels["pixel_values"].to(dtype=self.built.model.dtype)
        ids = self.family.bench_prompt_ids(self.built.model, special, head, tail, pixels)
        inputs["input_ids"] = torch.tensor([ids], dtype=torch.long)
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


# ---- one measurement -------------------------------------------------------------------------------------------
@dataclass
class Samples:
    timings: list[Timings] = field(default_factory=list)
    peak_bytes: int = 0
    n_prompt_tokens: int = 0
    n_image_tokens: int = 0

    def values(self, name: str) -> list[float]:
        if name == "lm_s":
            return [t.prefill_s + t.first_token_s for t in self.timings]
        return [getattr(t, name) for t in self.timings]

    def median(self, name: str) -> float:
        return statistics.median(self.values(name))

    def min(self, name: str) -> float:
        return min(self.values(name))


def run_once(adapter, requests: Requests, point: Point, mode: str, pop: PopConfig, timer=time.perf_counter
             ) -> GenerationResult:
    device = requests.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = timer()
    inputs = requests.make(point)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result = GenerationResult(timings=Timings(preprocess_s=timer() - start))
    for _ in generate_tokens(adapter, inputs, mode=mode, pop=pop, max_new_tokens=1, result=result, timer=timer):
        pass
    return result


def measure_point(adapter, requests, point: Point, modes, pop: PopConfig, repeats: int, warmup: int,
                  timer=time.perf_counter, log=None) -> dict[str, Samples]:
    samples = {mode: Samples() for mode in modes}
    # Warm-up (fused K/V weights are built here, once per skipped-layer set), then one untimed pass per mode that
    # reads the peak memory (its sampling thread stays out of the timed runs).
    for _ in range(warmup):
        for mode in modes:
            run_once(adapter, requests, point, mode, pop, timer)
    for mode in modes:
        with PeakWatcher(requests.device) as watch:
            result = run_once(adapter, requests, point, mode, pop, timer)
        samples[mode].peak_bytes = watch.delta
        samples[mode].n_prompt_tokens = result.prompt.length
        samples[mode].n_image_tokens = result.prompt.n_image_tokens
    for r in range(repeats):
        order = list(modes[r % len(modes):]) + list(modes[: r % len(modes)])
        for mode in order:
            result = run_once(adapter, requests, point, mode, pop, timer)
            samples[mode].timings.append(result.timings)
        if log:
            lm = "  ".join(f"{m} {samples[m].timings[-1].prefill_s + samples[m].timings[-1].first_token_s:.3f}s" for m in modes)
            log(f"  repeat {r + 1}/{repeats}: {lm}")
    return samples


# ---- the benchmark ---------------------------------------------------------------------------------------------
def parse_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"expected a comma-separated list of integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise ValueError(f"expected non-negative integers, got {text!r}")
    return values


def resolve_vocab(vocab: str | int | None, scale: float) -> int | None:
    """'auto': the real vocabulary at scale 1, 16384 entries on scaled runs. 'real' or 0: the real one."""
    if vocab in (None, "auto"):
        return None if scale >= 1.0 else 16384
    if vocab in ("real", 0, "0"):
        return None
    return int(vocab)


def run_bench(config: BenchConfig | None = None, log=None) -> dict:
    """Run the benchmark; returns {"meta": ..., "points": [one row per (point, mode)]}."""
    config = config or BenchConfig()
    log = log or (lambda msg: None)
    from .loading import resolve_device, resolve_dtype

    dev = resolve_device(config.device)
    torch_dtype = resolve_dtype(config.dtype, dev)
    if config.threads:
        torch.set_num_threads(int(config.threads))
    clock = config.resolved_clock(dev)
    modes = list(config.modes)
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    if "full" not in modes:
        modes = ["full", *modes]  # speedups are measured against full in the same run
    tuned = tune_malloc() if (config.malloc_tuning and dev.type == "cpu") else False
    vocab_size = resolve_vocab(config.vocab, config.scale)
    start = time.perf_counter()
    built = archs.build(config.arch, scale=config.scale, vocab=vocab_size, dtype=torch_dtype, device=dev)
    log(f"built {config.arch} at scale {config.scale} ({archs.parameter_count(built.model) / 1e6:.1f} M parameters, "
        f"{torch_dtype}, {dev}) in {time.perf_counter() - start:.1f}s")
    adapter = detect_family(built.model)
    pop = PopConfig(prune_layers=config.prune_layers)
    k = pop.num_pruned(adapter.num_layers)
    shape = DecoderShape.from_config(built.model.config)
    requests = Requests(built, dev)
    points = [Point(t) for t in config.tokens]
    if built.is_multimodal:
        points += [Point(config.image_text_tokens, s) for s in config.image_sizes]
    rows = []
    for point in points:
        log(f"point: {point.text_tokens} text tokens" + (f", {point.image_size}px image" if point.image_size else ""))
        with denormals_flushed():
            samples = measure_point(adapter, requests, point, modes, pop, config.repeats, config.warmup,
                                    clock_timer(clock), log)
        rows += point_rows(config.arch, point, samples, modes, shape, k)
    meta = {
        "arch": config.arch, "hub_id": archs.ARCHS[config.arch]["hub_id"], "scale": config.scale,
        "num_layers": adapter.num_layers, "prune_layers": k,
        "pruned": list(range(adapter.num_layers - k, adapter.num_layers)),
        "hidden": shape.hidden, "intermediate": shape.intermediate, "heads": shape.heads, "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim, "vocab": shape.vocab, "vocab_shrunk": vocab_size is not None,
        "parameters": archs.parameter_count(built.model), "device": str(dev), "dtype": str(torch_dtype).split(".")[-1],
        "threads": torch.get_num_threads(), "clock": clock, "repeats": config.repeats, "warmup": config.warmup,
        "malloc_tuned": tuned, **environment(dev),
        "speedup": "median(full LM time) / median(mode LM time); LM time = prefill_s + first_token_s",
    }
    return {"meta": meta, "points": rows}


def environment(device: torch.device) -> dict:
    """What a result was measured with: library versions, the machine, the date."""
    return {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "machine": machine_description(device), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def point_rows(arch: str, point: Point, samples: dict[str, Samples], modes, shape: DecoderShape, k: int) -> list[dict]:
    """One result row per mode of a measured point, with its speedups over full and its FLOP limit."""
    full = samples["full"]
    n = full.n_prompt_tokens
    rows = []
    for mode in modes:
        s = samples[mode]
        limit = flop_limit(shape, n, mode, k)
        speedup = full.median("lm_s") / s.median("lm_s")
        rows.append({
            "arch": arch, "tokens": n, "text_tokens": point.text_tokens, "image_size": point.image_size,
            "vision_tokens": s.n_image_tokens, "mode": mode, "k": 0 if mode == "full" else k,
            "preprocess_s": s.median("preprocess_s"), "vision_s": s.median("vision_s"),
            "prefill_s": s.median("prefill_s"), "first_token_s": s.median("first_token_s"),
            "lm_s": s.median("lm_s"), "lm_min_s": s.min("lm_s"),
            "ttft_s": s.median("ttft_s"), "ttft_min_s": s.min("ttft_s"),
            "speedup": speedup, "speedup_min": full.min("lm_s") / s.min("lm_s"),
            "ttft_speedup": full.median("ttft_s") / s.median("ttft_s"),
            "flop_limit": limit, "fraction_of_limit": speedup / limit,
            "gflops": prefill_flops(shape, n, mode, k) / 1e9,
            "peak_memory_bytes": s.peak_bytes, "repeats": len(s.timings),
        })
    return rows


# ---- output ----------------------------------------------------------------------------------------------------
BENCH_COLUMNS = (
    Column("tokens", lambda r: r["tokens"], 6), Column("image", lambda r: r["image_size"] or "-", 5),
    Column("vis tok", lambda r: r["vision_tokens"], 7), Column("mode", lambda r: r["mode"], 6, left=True),
    Column("preproc", ms("preprocess_s"), 7), Column("vision", ms("vision_s"), 7), Column("prefill", ms("prefill_s"), 8),
    Column("1st tok", ms("first_token_s"), 7), Column("LM", ms("lm_s"), 8), Column("LM min", ms("lm_min_s"), 8),
    Column("TTFT", ms("ttft_s"), 8), Column("speedup", lambda r: f"{r['speedup']:.3f}x", 7),
    Column("(min)", lambda r: f"{r['speedup_min']:.3f}x", 6), Column("limit", lambda r: f"{r['flop_limit']:.3f}x", 6),
    Column("of lim", lambda r: f"{r['fraction_of_limit'] * 100:.1f}%", 6),
    Column("peak MiB", lambda r: f"{r['peak_memory_bytes'] / 2 ** 20:.0f}", 8),
)
SUMMARY_KEYS = ("arch", "tokens", "image_size", "vision_tokens", "mode", "prefill_s", "first_token_s", "lm_s", "ttft_s",
                "speedup", "speedup_min", "flop_limit", "fraction_of_limit", "peak_memory_bytes")


def format_table(report: dict) -> str:
    meta = report["meta"]
    head = (f"{meta['arch']} ({meta['hub_id']} shape, scale {meta['scale']}, {meta['num_layers']} layers, "
            f"k={meta['prune_layers']}, {meta['dtype']}, {meta['device']}, {meta['threads']} thread(s), {meta['clock']} clock, "
            f"{meta['repeats']} repeats; times are medians, ms)")
    return "\n".join([head, *text_table(BENCH_COLUMNS, report["points"]),
                      "speedup: LM time (prefill + first token) of full over the mode; limit: the FLOP count's; "
                      "peak: memory in use above the model's weights during the request"])


def write_outputs(report: dict, out: str | os.PathLike) -> list[Path]:
    meta = report["meta"]
    stem = f"bench-{meta['arch']}-s{meta['scale']}-{meta['device'].split(':')[0]}"
    json_path = write_json(report, Path(out) / f"{stem}.json")
    png_path = Path(out) / f"{stem}.png"
    plots.bench_speedups(report, png_path)
    return [json_path, png_path]


def summary_line(report: dict) -> str:
    return report_summary_line(report, "points", SUMMARY_KEYS)


def cmd_bench(args) -> int:
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not args.quiet else None
    config = BenchConfig(
        arch=args.arch, scale=args.scale, tokens=tuple(parse_ints(args.tokens)),
        image_sizes=tuple(parse_ints(args.image_sizes)), image_text_tokens=args.image_text_tokens,
        modes=tuple(m for m in args.modes.split(",") if m), prune_layers=args.prune_layers, repeats=args.repeats,
        warmup=args.warmup, threads=args.threads, device=args.device, dtype=args.dtype, vocab=args.vocab,
        clock=args.clock, malloc_tuning=not args.no_malloc_tuning,
    )
    report = run_bench(config, log=log)
    if not args.json:
        print(format_table(report))
    if args.out:
        for path in write_outputs(report, args.out):
            print(f"wrote {path}", file=sys.stderr)
    print(summary_line(report), flush=True)
    return 0


def add_parser(sub, parse_prune_layers) -> None:
    d = BenchConfig()
    bench = sub.add_parser("bench", help="TTFT benchmark: full vs POP vs static against the FLOP limit")
    bench.add_argument("--arch", choices=list(archs.ARCHS), default=d.arch)
    bench.add_argument("--scale", type=float, default=d.scale, help="width scale in (0, 1] (layers and layer types kept)")
    bench.add_argument("--tokens", default=",".join(map(str, d.tokens)), help="text prompt lengths, comma-separated")
    bench.add_argument("--image-sizes", default=",".join(map(str, d.image_sizes)),
                       help="square image sides in pixels (VLMs; each with --image-text-tokens text tokens); '' for none")
    bench.add_argument("--image-text-tokens", type=int, default=d.image_text_tokens)
    bench.add_argument("--modes", default=",".join(d.modes))
    bench.add_argument("--prune-layers", type=parse_prune_layers, default=d.prune_layers,
                       help="k or a fraction of L (default L/3)")
    bench.add_argument("--repeats", type=int, default=d.repeats)
    bench.add_argument("--warmup", type=int, default=d.warmup)
    bench.add_argument("--threads", type=int, default=d.threads, help="torch threads (default: torch's choice)")
    bench.add_argument("--device", default=d.device)
    bench.add_argument("--dtype", default=d.dtype, help="auto: bf16 on CUDA, fp32 on CPU")
    bench.add_argument("--vocab", default=d.vocab,
                       help="vocabulary size: auto (real at scale 1, 16384 when scaled), real, or a number")
    bench.add_argument("--clock", default=d.clock, choices=["auto", "cpu", "wall"],
                       help="cpu: the thread's CPU time (default for 1-thread CPU runs: immune to time-slicing by other "
                            "processes); wall: wall clock (default otherwise, and on CUDA, with synchronisation)")
    bench.add_argument("--out", help="folder for the JSON report and the PNG plot")
    bench.add_argument("--json", action="store_true", help="print only the final JSON line")
    bench.add_argument("--quiet", action="store_true", help="no progress on stderr")
    bench.add_argument("--no-malloc-tuning", action="store_true", help="leave glibc's mmap/trim thresholds alone")
    bench.set_defaults(func=cmd_bench)
