"""Full vs POP on one request, as the page and `/compare` show it: one preprocessing and vision pass shared by both
sides, each side's own language-model stages, the speedups with what each compares; and one chat turn."""
from __future__ import annotations

import os

from pop_vlm import PopConfig
from pop_vlm.config import parse_prune_layers

from .models import ModelManager


def uploaded_path(payload) -> str | None:
    """The file behind a raw image payload (handlers take payloads unprocessed, so that the library reads the
    file and an unreadable upload gets the library's clear message rather than a server error)."""
    if payload is None or isinstance(payload, str):
        return payload
    if isinstance(payload, dict):
        return payload.get("path")
    return getattr(payload, "path", None)


def lm_seconds(timings) -> float:
    """What POP changes: the language model's prefill and first token."""
    return timings.prefill_s + timings.first_token_s


def shared_markdown(answer) -> str:
    """The stages both sides share: one preprocessing and one vision-encoder pass of the same request."""
    t = answer.timings
    return (f"**Shared by both sides** (one pass, used by each): preprocess {t.preprocess_s * 1e3:.1f} ms · "
            f"vision encoder {t.vision_s * 1e3:.1f} ms · {answer.n_prompt_tokens} prompt tokens "
            f"({answer.n_image_tokens} image)")


def timing_markdown(answer) -> str:
    """One side's own stages: the language model's prefill and first token, then decode."""
    t = answer.timings
    pruned = f" · prefill skips layers {answer.pruned_layers[0]}–{answer.pruned_layers[-1]}" if answer.pruned_layers else ""
    return (f"**LM to first token {lm_seconds(t) * 1e3:.1f} ms** (prefill {t.prefill_s * 1e3:.1f} · first token "
            f"{t.first_token_s * 1e3:.1f} ms) · TTFT {t.ttft_s * 1e3:.1f} ms  \n"
            f"decode {t.decode_tokens_per_s:.1f} tok/s{pruned}")


def speedups(full, pop) -> tuple[float | None, float | None]:
    """(TTFT speedup, LM-only speedup) of POP over full, from their Timings."""
    ttft = full.ttft_s / pop.ttft_s if pop.ttft_s > 0 else None
    lm = lm_seconds(full) / lm_seconds(pop) if lm_seconds(pop) > 0 else None
    return ttft, lm


def speedup_markdown(results: dict, repeats: int = 1) -> str:
    if "full" not in results or "pop" not in results:
        return ""
    ttft, lm = speedups(results["full"].timings, results["pop"].timings)
    runs = f" · median of {repeats} runs of each side" if repeats > 1 else ""
    return (f"## POP TTFT speedup ×{ttft:.2f}\n"
            f"request to first token: the shared preprocessing and vision pass + each side's prefill and first token  \n"
            f"**LM-only speedup ×{lm:.2f}** — prefill + first token, the part POP changes{runs}\n\n"
            + shared_markdown(results["pop"]))


def median_run(answers: list):
    """The run whose LM time is the median (the lower middle one for an even count)."""
    ranked = sorted(answers, key=lambda a: lm_seconds(a.timings))
    return ranked[(len(ranked) - 1) // 2]


def comparison(manager: ModelManager, image, question, model, prune_layers, max_new_tokens, *,
               kv_projection=True, boundary=True, with_static=False, pop_first=False, repeats: int = 1):
    """Run full and POP (and static) on one prepared request — one preprocessing and one vision-encoder pass shared by
    every side — and yield (mode, text so far, Answer or None). With `repeats` > 1 the sides' language-model stages
    run that many times, interleaved in alternating order, and each side's median run (by LM time) comes last."""
    limits = manager.limits
    image = uploaded_path(image)
    if isinstance(image, str) and os.path.isfile(image) and os.path.getsize(image) == 0:
        raise ValueError("The uploaded image file is empty (0 bytes).")
    if question is None or (isinstance(question, str) and not question.strip()):
        raise ValueError("The question is empty: please type a question.")
    question = limits.clean_question(question)
    max_new_tokens = limits.check_new_tokens(max_new_tokens)
    if not isinstance(repeats, int) or not 1 <= repeats <= 5:
        raise ValueError(f"repeats must be an integer from 1 to 5, got {repeats!r}")
    if isinstance(image, str) and os.path.isfile(image) and os.path.getsize(image) > limits.max_upload_bytes:
        raise ValueError(f"the image file is larger than {limits.max_upload_bytes // (1024 * 1024)} MB")
    pipe = manager.get(model)
    if image is not None and not pipe.is_multimodal:
        raise ValueError(f"{model or manager.default} is a text-only model: remove the image or pick a VLM")
    pop = PopConfig(prune_layers=parse_prune_layers(prune_layers), kv_projection=kv_projection, boundary=boundary)
    modes = ["pop", "full"] if pop_first else ["full", "pop"]
    if with_static:
        modes.append("static")
    prepared = pipe.prepare(image, question)

    def run(mode):
        return pipe.stream_prepared(prepared, mode=mode, pop=pop, max_new_tokens=max_new_tokens,
                                    time_limit_s=limits.request_timeout_s)

    first_round = [(mode, run(mode)) for mode in modes]  # every check before any model work
    answers: dict[str, list] = {mode: [] for mode in modes}
    with manager.admitted():
        for round_index in range(repeats):
            order = modes if round_index % 2 == 0 else modes[::-1]
            streams = first_round if round_index == 0 else [(mode, run(mode)) for mode in order]
            for mode, stream in streams:
                text = ""
                for piece in stream:
                    if isinstance(piece, str):
                        text += piece
                        yield mode, text, None
                    else:
                        answers[mode].append(piece)
                        yield mode, piece.text, piece
        if repeats > 1:
            for mode in modes:
                best = median_run(answers[mode])
                yield mode, best.text, best


def chat_turn(manager: ModelManager, image, question, model, mode, prune_layers, max_new_tokens, messages):
    """Validate one chat turn and return (the conversation with it, the answer's stream)."""
    limits = manager.limits
    question = limits.clean_question(question or "")
    max_new_tokens = limits.check_new_tokens(max_new_tokens)
    pipe = manager.get(model)
    content = [{"type": "text", "text": question}]
    if not messages and image is not None:
        content.insert(0, {"type": "image", "image": image})
    turn = list(messages) + [{"role": "user", "content": content}]
    pop = PopConfig(prune_layers=parse_prune_layers(prune_layers))
    pieces = pipe.stream_chat(turn, mode=mode, pop=pop, max_new_tokens=max_new_tokens, reuse_prefix=True,
                              time_limit_s=limits.request_timeout_s)
    return turn, pieces


def chat_timing_markdown(answer) -> str:
    t = answer.timings
    return (f"**TTFT {t.ttft_s * 1e3:.1f} ms** — {t.n_cached_tokens} of {answer.n_prompt_tokens} prompt tokens "
            f"reused from the conversation's cache; vision {t.vision_s * 1e3:.1f} ms, prefill {t.prefill_s * 1e3:.1f} ms, "
            f"first token {t.first_token_s * 1e3:.1f} ms; decode {t.decode_tokens_per_s:.1f} tok/s")


def compare_json(manager: ModelManager, image, question, model, prune_layers, max_new_tokens) -> dict:
    """Both answers and both timing sets, as the `/compare` API returns them. Both sides report the same
    `preprocess_s` and `vision_s` (one shared pass, also given as `shared`)."""
    results = {}
    for mode, _, answer in comparison(manager, image, question, model, prune_layers, max_new_tokens):
        if answer is not None:
            results[mode] = answer
    ttft, lm = speedups(results["full"].timings, results["pop"].timings)
    shared = results["pop"].timings
    return {
        "model": model or manager.default,
        "question": question,
        "shared": {"preprocess_s": shared.preprocess_s, "vision_s": shared.vision_s},
        "full": results["full"].as_dict(),
        "pop": results["pop"].as_dict(),
        "ttft_speedup": ttft,
        "lm_speedup": lm,
    }
