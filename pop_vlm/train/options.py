"""Command-line options of the demo-model training (`scripts/train_demo_vlm.py`): one set of defaults."""
from __future__ import annotations

import argparse

from . import lora
from .families import FAMILIES, family


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3-vl", help="model family of the demo model")
    p.add_argument("--minutes", type=float, default=150.0, help="wall-clock budget of this run")
    p.add_argument("--steps", type=int, default=None, help="stop once training reaches this step (default: no limit)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export-every", type=float, default=10.0, help="minutes between exports of the best model")
    p.add_argument("--eval-every", type=float, default=5.0, help="minutes between held-out evaluations")
    p.add_argument("--checkpoint-every", type=float, default=5.0, help="minutes between checkpoints")
    p.add_argument("--out-dir", default=None,
                   help="checkpoints and log (default: <cache>/train/<model name>, <cache> as for converted models: "
                        "$POP_VLM_CACHE, else $XDG_CACHE_HOME/pop-vlm, else $HF_HOME/pop-vlm, else ~/.cache/pop-vlm)")
    p.add_argument("--export-dir", default=None, help="default: assets/models/<model name>")
    p.add_argument("--export-dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--ship", metavar="FOLDER", default=None,
                   help="train nothing: turn FOLDER, a whole export (save_pretrained) of --family's model, into the "
                        "shipped form (trained weights only) in --export-dir")
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    p.add_argument("--init-from", metavar="FOLDER", default=None,
                   help="without a checkpoint (or with --fresh): start from the weights of FOLDER, an export of this "
                        "family's model, at the step its training_curve.json records, with fresh optimisers")
    p.add_argument("--profile", type=int, default=0, help="time this many steps and exit")
    _data_options(p)
    _model_options(p)
    _optimisation_options(p)
    return p


def _data_options(p):
    p.add_argument("--images-per-step", type=int, default=8)
    p.add_argument("--questions-per-image", type=int, default=6)
    p.add_argument("--stage1-images", type=int, default=4000)
    p.add_argument("--stage2-images", type=int, default=14000)
    p.add_argument("--val-size", type=int, default=250)
    p.add_argument("--test-size", type=int, default=0, help="test records scored at export (0: all)")
    # image processing
    p.add_argument("--patch-size", type=int, default=16)
    p.add_argument("--max-pixels", type=int, default=144 * 32 * 32)
    p.add_argument("--min-pixels", type=int, default=4 * 32 * 32)
    p.add_argument("--image-size", type=int, default=128, help="gemma3: side of the square input image")
    p.add_argument("--image-tokens", type=int, default=64, help="gemma3: image tokens per image (a square number)")


def _model_options(p):
    p.add_argument("--text-layers", type=int, default=6)
    p.add_argument("--text-width", type=int, default=192)
    p.add_argument("--text-ffn", type=int, default=512)
    p.add_argument("--text-head-dim", type=int, default=32)
    p.add_argument("--vision-layers", type=int, default=3)
    p.add_argument("--vision-width", type=int, default=128)
    p.add_argument("--vision-pos-grid", type=int, default=32)
    p.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help=f"gemma3: trainable low-rank adapters of rank R (at most {lora.MAX_RANK}) on the frozen language "
                        "model, merged into it at load (0: none); a run resumed with them added starts them at zero")
    p.add_argument("--lora-alpha", type=float, default=None, help="the adapters' update is scaled by alpha / R (default: 2R)")
    p.add_argument("--lora-targets", default=lora.DEFAULT_TARGETS,
                   help=f"adapted Linear layers of every decoder layer, among {','.join(lora.TARGETS)} "
                        f"(default: the attention's {lora.DEFAULT_TARGETS})")


def _optimisation_options(p):
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-steps", type=int, default=150)
    p.add_argument("--total-steps", type=int, default=5000, help="length of the LR schedule")
    p.add_argument("--aux-weight", type=float, default=0.5)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--autocast", choices=["none", "bf16"], default="none",
                   help="bf16: forward and backward matmuls in bfloat16 (weights and optimiser stay float32); "
                        "several times faster on GPUs and on CPUs with native bf16 (AVX512-BF16, AMX)")
    p.add_argument("--word-weight", type=float, default=0.5, help="weight of the question-word referent loss")
    p.add_argument("--word-layer", type=int, default=2, help="decoder layer whose output the word heads read")


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    """Parsed options; a word layer outside the text layers is a usage error, not a traceback later."""
    parser = build_parser(description)
    args = parser.parse_args(argv)
    if not 0 <= args.word_layer < args.text_layers:
        parser.error(f"--word-layer must be between 0 and --text-layers - 1 ({args.text_layers - 1})")
    if args.steps is not None and args.steps < 0:
        parser.error("--steps must be >= 0")
    builder = family(args.family)
    check = getattr(builder, "options_problem", None)
    if check and (problem := check(args)):
        parser.error(problem)
    if problem := lora.options_problem(args, builder):
        parser.error(problem)
    return args
