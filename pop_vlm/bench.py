"""TTFT benchmark: full vs POP vs static over prompt lengths and image sizes, against the FLOP limit.

Models are the real architectures of `pop_vlm.archs` with random weights (optionally width-scaled); prompts are
synthetic token ids, and images synthetic noise run through the model's real image processor. Every request goes
through `generate_tokens` (the engine's one generation loop) with one new token, so the timings are the engine's
own `Timings`: preprocessing (image processor, prompt ids), vision encoder, LM prefill, first token (POP: the
boundary step). Modes are interleaved within each repeat, in a rotating order, so drift hits all of them alike;
speedups are ratios of medians (and of minimums) measured in the same run.
"""
from __future__ import annotations

import ctypes
import json
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import archs
from .config import MODES, PopConfig
from .families import adapter_class_for
from .flops import DecoderShape, flop_limit, prefill_flops
from .generate import GenerationResult, StageClock, Timings, generate_tokens

DEFAULT_TOKENS = "32,128,512,1024,2048,4096"
DEFAULT_IMAGE_SIZES = "448,896,1344,1792"


# ---- allocator and memory ------------------------------------------------------------------------------------
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def tune_malloc() -> bool:
    """Keep freed memory in glibc's heap: no mmap/munmap and page faults for every large activation.

    The same as MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ set high in the environment; without it the full
    path pays page faults on every layer and looks slower than it is.
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    ok = libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) == 1
    return bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 40) == 1 and ok)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


class HostMemory:
    """Bytes the process has allocated from glibc right now (in use, not resident): torch's CPU tensors live there."""

    def __init__(self):
        libc = _libc()
        self.fn = getattr(libc, "mallinfo2", None) if libc is not None else None
        if self.fn is not None:
            self.fn.restype = _MallInfo2

    @property
    def available(self) -> bool:
        return self.fn is not None

    def in_use(self) -> int:
        info = self.fn()
        return int(info.uordblks + info.hblkhd)


class PeakWatcher:
    """Peak bytes in use above the level at start, during a block. CUDA: the allocator's own peak; CPU: glibc's
    in-use bytes sampled every 0.2 ms by a thread (used on untimed runs only)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host = HostMemory() if device.type != "cuda" else None
        self.peak = 0
        self.base = 0
        self._stop = threading.Event()

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.host.available:
            self.base = self.peak = self.host.in_use()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.host.in_use())
            time.sleep(0.0002)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.host.available:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self.host.in_use())
        return False

    @property
    def delta(self) -> int:
        return max(0, self.peak - self.base)


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


def run_once(built: archs.Built, adapter, requests: Requests, point: Point, mode: str, pop: PopConfig) -> GenerationResult:
    device = requests.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timer = StageClock.timer
    start = timer()
    inputs = requests.make(point)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result = GenerationResult(timings=Timings(preprocess_s=timer() - start))
    for _ in generate_tokens(adapter, inputs, mode=mode, pop=pop, max_new_tokens=1, result=result):
        pass
    return result


def measure_point(built, adapter, requests, point: Point, modes, pop: PopConfig, repeats: int, warmup: int,
                  log=None) -> dict[str, Samples]:
    samples = {mode: Samples() for mode in modes}
    # Warm-up (fused K/V weights are built here, once per skipped-layer set), then one untimed pass per mode that
    # reads the peak memory (its sampling thread stays out of the timed runs).
    for _ in range(warmup):
        for mode in modes:
            run_once(built, adapter, requests, point, mode, pop)
    for mode in modes:
        with PeakWatcher(requests.device) as watch:
            result = run_once(built, adapter, requests, point, mode, pop)
        samples[mode].peak_bytes = watch.delta
        samples[mode].n_prompt_tokens = result.prompt.length
        samples[mode].n_image_tokens = result.prompt.n_image_tokens
    for r in range(repeats):
        order = list(modes[r % len(modes):]) + list(modes[: r % len(modes)])
        for mode in order:
            result = run_once(built, adapter, requests, point, mode, pop)
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


def run_bench(arch: str = "qwen3-vl-2b", scale: float = 0.25, tokens=(512, 1024, 2048), image_sizes=(),
              modes=MODES, prune_layers=1 / 3, repeats: int = 3, warmup: int = 1, threads: int | None = 1,
              device: str = "auto", dtype: str = "auto", vocab="auto", image_text_tokens: int = 64,
              malloc_tuning: bool = True, clock: str = "auto", log=None) -> dict:
    from .families import detect_family
    from .pipeline import resolve_device, resolve_dtype

    log = log or (lambda msg: None)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if threads:
        torch.set_num_threads(int(threads))
    if clock == "auto":
        clock = "cpu" if (dev.type == "cpu" and torch.get_num_threads() == 1) else "wall"
    if clock not in ("cpu", "wall"):
        raise ValueError(f"--clock must be auto, cpu or wall, not {clock!r}")
    if clock == "cpu" and (dev.type != "cpu" or torch.get_num_threads() != 1):
        raise ValueError("--clock cpu measures the calling thread: only for --device cpu --threads 1")
    previous_timer = StageClock.timer
    StageClock.timer = staticmethod(time.thread_time if clock == "cpu" else time.perf_counter)
    try:
        return _run(arch, scale, tokens, image_sizes, modes, prune_layers, repeats, warmup, dev, torch_dtype, vocab,
                    image_text_tokens, malloc_tuning, clock, log)
    finally:
        StageClock.timer = previous_timer


def _run(arch, scale, tokens, image_sizes, modes, prune_layers, repeats, warmup, dev, torch_dtype, vocab,
         image_text_tokens, malloc_tuning, clock, log) -> dict:
    from .families import detect_family

    tuned = tune_malloc() if (malloc_tuning and dev.type == "cpu") else False
    torch.set_flush_denormal(True)
    modes = [m for m in modes]
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    if "full" not in modes:
        modes = ["full", *modes]  # speedups are measured against full in the same run
    vocab_size = resolve_vocab(vocab, scale)
    start = time.perf_counter()
    built = archs.build(arch, scale=scale, vocab=vocab_size, dtype=torch_dtype, device=dev)
    log(f"built {arch} at scale {scale} ({archs.parameter_count(built.model) / 1e6:.1f} M parameters, "
        f"{torch_dtype}, {dev}) in {time.perf_counter() - start:.1f}s")
    adapter = detect_family(built.model)
    pop = PopConfig(prune_layers=prune_layers)
    k = pop.num_pruned(adapter.num_layers)
    shape = DecoderShape.from_config(built.model.config)
    requests = Requests(built, dev)

    points = [Point(t) for t in tokens]
    if built.is_multimodal:
        points += [Point(image_text_tokens, s) for s in image_sizes]
    rows = []
    for point in points:
        log(f"point: {point.text_tokens} text tokens" + (f", {point.image_size}px image" if point.image_size else ""))
        samples = measure_point(built, adapter, requests, point, modes, pop, repeats, warmup, log)
        full = samples["full"]
        n = full.n_prompt_tokens
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
    meta = {
        "arch": arch, "hub_id": archs.ARCHS[arch]["hub_id"], "scale": scale, "num_layers": adapter.num_layers,
        "prune_layers": k, "pruned": list(range(adapter.num_layers - k, adapter.num_layers)),
        "hidden": shape.hidden, "intermediate": shape.intermediate, "heads": shape.heads, "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim, "vocab": shape.vocab, "vocab_shrunk": vocab_size is not None,
        "parameters": archs.parameter_count(built.model), "device": str(dev), "dtype": str(torch_dtype).split(".")[-1],
        "threads": torch.get_num_threads(), "clock": clock, "repeats": repeats, "warmup": warmup, "malloc_tuned": tuned,
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "machine": machine_description(dev), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "speedup": "median(full LM time) / median(mode LM time); LM time = prefill_s + first_token_s",
    }
    return {"meta": meta, "points": rows}


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs"


# ---- output ----------------------------------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.0f}"


def format_table(report: dict) -> str:
    meta = report["meta"]
    head = (f"{meta['arch']} ({meta['hub_id']} shape, scale {meta['scale']}, {meta['num_layers']} layers, "
            f"k={meta['prune_layers']}, {meta['dtype']}, {meta['device']}, {meta['threads']} thread(s), {meta['clock']} clock, "
            f"{meta['repeats']} repeats; times are medians, ms)")
    cols = (f"{'tokens':>7}{'image':>6}{'vis tok':>8} {'mode':<7}{'preproc':>8}{'vision':>8}{'prefill':>9}{'1st tok':>8}"
            f"{'LM':>9}{'LM min':>9}{'TTFT':>9}{'speedup':>8}{'(min)':>7}{'limit':>7}{'of lim':>7}{'peak MiB':>9}")
    lines = [head, cols, "-" * len(cols)]
    for r in report["points"]:
        lines.append(
            f"{r['tokens']:>7}{r['image_size'] or '-':>6}{r['vision_tokens']:>8} {r['mode']:<7}"
            f"{r['preprocess_s'] * 1e3:>8.1f}{r['vision_s'] * 1e3:>8.1f}{r['prefill_s'] * 1e3:>9.1f}"
            f"{r['first_token_s'] * 1e3:>8.1f}{r['lm_s'] * 1e3:>9.1f}{r['lm_min_s'] * 1e3:>9.1f}{r['ttft_s'] * 1e3:>9.1f}"
            f"{r['speedup']:>7.3f}x{r['speedup_min']:>6.3f}x{r['flop_limit']:>6.3f}x{r['fraction_of_limit'] * 100:>6.1f}%"
            f"{_mib(r['peak_memory_bytes']):>9}"
        )
    lines.append("speedup: LM time (prefill + first token) of full over the mode; limit: the FLOP count's; "
                 "peak: memory in use above the model's weights during the request")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = report["meta"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"pop": "tab:blue", "static": "tab:orange", "full": "tab:gray"}
    for mode in ("pop", "static"):
        text = sorted((r for r in report["points"] if r["mode"] == mode and not r["image_size"]), key=lambda r: r["tokens"])
        image = sorted((r for r in report["points"] if r["mode"] == mode and r["image_size"]), key=lambda r: r["tokens"])
        if not text and not image:
            continue
        if text:
            ax.plot([r["tokens"] for r in text], [r["speedup"] for r in text], "o-", color=colors[mode], label=f"{mode}: measured (text)")
            ax.plot([r["tokens"] for r in text], [r["flop_limit"] for r in text], "--", color=colors[mode], label=f"{mode}: FLOP limit")
        if image:
            ax.plot([r["tokens"] for r in image], [r["speedup"] for r in image], "s:", color=colors[mode],
                    label=f"{mode}: measured (image + {image[0]['text_tokens']} text)")
    ax.axhline(1.0, color=colors["full"], lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("LM prefill speedup over full")
    ax.set_title(f"{meta['arch']} (scale {meta['scale']}, k={meta['prune_layers']}/{meta['num_layers']}, "
                 f"{meta['dtype']}, {meta['device']})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(report: dict, out: str | os.PathLike) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = report["meta"]
    stem = f"bench-{meta['arch']}-s{meta['scale']}-{meta['device'].split(':')[0]}"
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    png_path = out / f"{stem}.png"
    plot(report, png_path)
    return [json_path, png_path]


def summary_line(report: dict) -> str:
    keys = ("arch", "tokens", "image_size", "vision_tokens", "mode", "prefill_s", "first_token_s", "lm_s", "ttft_s",
            "speedup", "speedup_min", "flop_limit", "fraction_of_limit", "peak_memory_bytes")
    points = [{k: (round(r[k], 6) if isinstance(r[k], float) else r[k]) for k in keys} for r in report["points"]]
    return json.dumps({"meta": report["meta"], "points": points})


def cmd_bench(args) -> int:
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not args.quiet else None
    report = run_bench(
        arch=args.arch, scale=args.scale, tokens=parse_ints(args.tokens), image_sizes=parse_ints(args.image_sizes),
        modes=[m for m in args.modes.split(",") if m], prune_layers=args.prune_layers, repeats=args.repeats,
        warmup=args.warmup, threads=args.threads, device=args.device, dtype=args.dtype, vocab=args.vocab,
        image_text_tokens=args.image_text_tokens, malloc_tuning=not args.no_malloc_tuning, clock=args.clock, log=log,
    )
    if not args.json:
        print(format_table(report))
    if args.out:
        for path in write_outputs(report, args.out):
            print(f"wrote {path}", file=sys.stderr)
    print(summary_line(report), flush=True)
    return 0


def add_parser(sub, parse_prune_layers) -> None:
    bench = sub.add_parser("bench", help="TTFT benchmark: full vs POP vs static against the FLOP limit")
    bench.add_argument("--arch", choices=list(archs.ARCHS), default="qwen3-vl-2b")
    bench.add_argument("--scale", type=float, default=1.0, help="width scale in (0, 1] (layers and layer types kept)")
    bench.add_argument("--tokens", default=DEFAULT_TOKENS, help="text prompt lengths, comma-separated")
    bench.add_argument("--image-sizes", default=DEFAULT_IMAGE_SIZES,
                       help="square image sides in pixels (VLMs; each with --image-text-tokens text tokens); '' for none")
    bench.add_argument("--image-text-tokens", type=int, default=64)
    bench.add_argument("--modes", default=",".join(MODES))
    bench.add_argument("--prune-layers", type=parse_prune_layers, default=1 / 3, help="k or a fraction of L (default L/3)")
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--warmup", type=int, default=1)
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    bench.add_argument("--device", default="auto")
    bench.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    bench.add_argument("--vocab", default="auto",
                       help="vocabulary size: auto (real at scale 1, 16384 when scaled), real, or a number")
    bench.add_argument("--clock", default="auto", choices=["auto", "cpu", "wall"],
                       help="cpu: the thread's CPU time (default for 1-thread CPU runs: immune to time-slicing by other "
                            "processes); wall: wall clock (default otherwise, and on CUDA, with synchronisation)")
    bench.add_argument("--out", help="folder for the JSON report and the PNG plot")
    bench.add_argument("--json", action="store_true", help="print only the final JSON line")
    bench.add_argument("--quiet", action="store_true", help="no progress on stderr")
    bench.add_argument("--no-malloc-tuning", action="store_true", help="leave glibc's mmap/trim thresholds alone")
    bench.set_defaults(func=cmd_bench)
