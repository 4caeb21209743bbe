"""The Gradio page: one question, answered by the full model and by POP side by side."""
from __future__ import annotations

import json
import os
from pathlib import Path

import gradio as gr
from pop_vlm import PopConfig, zoo

from .charts import importance_chart, ttft_chart
from .models import Busy, ModelError, ModelManager

def uploaded_path(payload) -> str | None:
    """The file behind a raw image payload (handlers take payloads unprocessed, so that the library reads the
    file and an unreadable upload gets the library's clear message rather than a server error)."""
    if payload is None or isinstance(payload, str):
        return payload
    if isinstance(payload, dict):
        return payload.get("path")
    return getattr(payload, "path", None)


def parse_prune_layers(value):
    """The k of a request: 'auto', an int, a fraction in (0, 1), or empty for the default (L/3)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return PopConfig().prune_layers
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value) if float(value).is_integer() else float(value)
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"prune_layers must be a layer count, a fraction of the layers, or 'auto'; got {value!r}") from None
    return int(number) if number.is_integer() else number


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


def default_depth(manager: ModelManager) -> int:
    """The depth slider's first value: k = L/3 of the default model, from its config (the weights may still be
    loading); 0 when the config cannot be read here."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(zoo.resolve(manager.check_name(None)))
    except Exception:  # noqa: BLE001 - the slider is refitted once the model has loaded (on_model)
        return 0
    return PopConfig().num_pruned(getattr(config, "text_config", config).num_hidden_layers)


def examples() -> list[list]:
    """Clickable examples: shapes-task images for the demo model, then real photos (assets/qa/examples.jsonl)."""
    listing = zoo.assets_dir() / "qa" / "examples.jsonl"
    if not listing.is_file():
        return []
    rows = [json.loads(line) for line in listing.read_text().splitlines() if line.strip()]
    return [[str(zoo.assets_dir() / row["image"]), row["question"]] for row in rows
            if (zoo.assets_dir() / row["image"]).is_file()]


def build_demo(manager: ModelManager) -> gr.Blocks:
    with gr.Blocks(title="pop-vlm: Prefill-Only Pruning") as demo:
        gr.Markdown("# pop-vlm — Prefill-Only Pruning\nThe prompt (and the image's tokens) run through the first "
                    "L−k layers only; the answer is decoded with the full model. Same question, both ways:")
        history = gr.State([])
        turn = gr.State(0)
        with gr.Tab("Full vs POP"), gr.Row():
            with gr.Column(scale=1):
                image = gr.Image(type="filepath", label="Image", elem_id="image", height=280)
                question = gr.Textbox(label="Question", placeholder="What is in the picture?", elem_id="question")
                model = gr.Dropdown(manager.choices(), value=manager.default, label="Model", allow_custom_value=True,
                                    info="bundled demo VLMs, gemma-3-270m (text only), a hub id or a local folder",
                                    elem_id="model")
                with gr.Row():
                    depth = gr.Slider(0, 64, value=default_depth(manager), step=1,
                                      label="POP depth k (layers skipped in prefill)", elem_id="depth")
                    auto = gr.Checkbox(label="auto k", value=False)
                max_new = gr.Slider(1, 256, value=32, step=1, label="max new tokens")
                repeat = gr.Checkbox(label="repeat 3× and take the median (steadier timings)", value=False,
                                     elem_id="repeat")
                with gr.Accordion("Advanced", open=False):
                    no_kv = gr.Checkbox(label="ablation: no KV projection for skipped layers")
                    no_boundary = gr.Checkbox(label="ablation: no boundary step (first token from pruned stack)")
                    with_static = gr.Checkbox(label="also run the static baseline (the same layers removed everywhere)")
                run = gr.Button("Ask both", variant="primary", elem_id="run")
                if examples():
                    gr.Examples(examples(), inputs=[image, question])
            with gr.Column(scale=2):
                speedup = gr.Markdown(label="speedup", elem_id="speedup")
                with gr.Row():
                    with gr.Column():
                        gr.Markdown("### Full model")
                        full_text = gr.Textbox(label="full model's answer", lines=4, elem_id="full-answer")
                        full_timing = gr.Markdown(label="full model's timings", elem_id="full-timing")
                    with gr.Column():
                        gr.Markdown("### POP")
                        pop_text = gr.Textbox(label="POP's answer", lines=4, elem_id="pop-answer")
                        pop_timing = gr.Markdown(label="POP's timings", elem_id="pop-timing")
                    with gr.Column(visible=False) as static_column:
                        gr.Markdown("### Static removal")
                        static_text = gr.Textbox(label="static removal's answer", lines=4, elem_id="static-answer")
                        static_timing = gr.Markdown(label="static removal's timings", elem_id="static-timing")
                chart = gr.Plot(label="time to first token", elem_id="ttft-chart")
                with gr.Accordion("Layer importance", open=True):
                    importance_plot = gr.Plot(label="prefill vs decode importance", elem_id="importance")
                    importance_note = gr.Markdown(label="importance profile")
                    compute = gr.Button("Compute importance for this model")

        with gr.Tab("Chat about an image"):
            gr.Markdown("Follow-up questions reuse the conversation's cache (the image's vision features and the KV "
                        "of everything said before): only the new question is prefilled.")
            with gr.Row():
                with gr.Column(scale=1):
                    chat_image = gr.Image(type="filepath", label="Image", elem_id="chat-image", height=240)
                    chat_mode = gr.Radio(["pop", "full"], value="pop", label="mode")
                    new_chat = gr.Button("New conversation")
                with gr.Column(scale=2):
                    chatbot = gr.Chatbot(label="conversation", elem_id="chatbot", height=320)
                    chat_input = gr.Textbox(label="Question", elem_id="chat-question", placeholder="Ask about the image")
                    chat_timing = gr.Markdown(label="timings", elem_id="chat-timing")
            conversation = gr.State([])

        def on_chat(image, question, model, mode, k, use_auto, max_new, messages, shown):
            try:
                turn_messages, pieces = chat_turn(manager, uploaded_path(image), question, model, mode,
                                                  prune_value(k, use_auto), max_new, messages)
                shown = shown + [{"role": "user", "content": question}, {"role": "assistant", "content": ""}]
                with manager.admitted():
                    for piece in pieces:
                        if isinstance(piece, str):
                            shown[-1]["content"] += piece
                            yield shown, "", messages, gr.skip()
                        else:
                            turn_messages.append({"role": "assistant", "content": [{"type": "text", "text": piece.text}]})
                            yield shown, "", turn_messages, chat_timing_markdown(piece)
            except (ValueError, ModelError, Busy) as err:
                raise gr.Error(str(err)) from None

        chat_inputs = [chat_image, chat_input, model, chat_mode, depth, auto, max_new, conversation, chatbot]
        chat_outputs = [chatbot, chat_input, conversation, chat_timing]
        chat_input.submit(on_chat, chat_inputs, chat_outputs, api_name="chat", concurrency_id="model",
                          concurrency_limit=1, preprocess=False)
        new_chat.click(lambda: ([], [], ""), None, [chatbot, conversation, chat_timing], api_visibility="private")
        chat_image.change(lambda: ([], [], ""), None, [chatbot, conversation, chat_timing], api_visibility="private")

        def prune_value(k, use_auto):
            return "auto" if use_auto else int(k)

        def on_model(model, k, use_auto):
            """Fit the depth slider to the model (default k = L/3) and show its importance profile."""
            try:
                pipe = manager.get(model)
            except (ValueError, ModelError) as err:
                return gr.update(), None, str(err)
            layers = pipe.num_layers
            value = PopConfig().num_pruned(layers)
            slider = gr.update(maximum=layers - 1, value=value)
            return (slider, *show_importance(model, value, use_auto))

        def on_run(image, question, model, k, use_auto, max_new, no_kv, no_boundary, with_static, repeat, history,
                   turn):
            repeats = 3 if repeat else 1
            texts = {"full": "", "pop": "", "static": ""}
            timings = {"full": "", "pop": "", "static": ""}
            results = {}

            def frame(chart_fig=gr.skip()):
                return (texts["full"], texts["pop"], texts["static"], timings["full"], timings["pop"], timings["static"],
                        speedup_markdown(results, repeats), chart_fig, history, turn + 1,
                        gr.update(visible=bool(with_static)))

            try:
                for mode, text, answer in comparison(
                    manager, image, question, model, prune_value(k, use_auto), max_new, kv_projection=not no_kv,
                    boundary=not no_boundary, with_static=with_static, pop_first=bool(turn % 2), repeats=repeats,
                ):
                    texts[mode] = text
                    if answer is not None:
                        results[mode] = answer
                        timings[mode] = timing_markdown(answer)
                    yield frame()
            except (ValueError, ModelError, Busy) as err:
                raise gr.Error(str(err)) from None
            history = history + [{m: a.timings.as_dict() for m, a in results.items()}]
            yield frame(ttft_chart(history))

        outputs = [full_text, pop_text, static_text, full_timing, pop_timing, static_timing, speedup, chart, history,
                   turn, static_column]
        run_inputs = [image, question, model, depth, auto, max_new, no_kv, no_boundary, with_static, repeat, history,
                      turn]
        run.click(on_run, run_inputs, outputs, api_name="ask", concurrency_id="model", concurrency_limit=1,
                  preprocess=False)
        question.submit(on_run, run_inputs, outputs, api_visibility="private", concurrency_id="model",
                        concurrency_limit=1, preprocess=False)

        def show_importance(model, k, use_auto):
            try:
                name = manager.check_name(model)
                profile = manager.cached_importance(name)
            except (ValueError, ModelError) as err:
                return None, str(err)
            if profile is None:
                return None, "No importance profile for this model yet: press *Compute importance*."
            layers = len(profile.prefill)
            try:
                k_value = PopConfig(prune_layers=prune_value(k, use_auto)).num_pruned(layers, profile.auto_k())
            except ValueError as err:
                return None, str(err)
            pruned = list(range(layers - k_value, layers))
            note = (f"{layers} layers; k = {k_value} shaded (auto k = {profile.auto_k()}). Shares of each stage's "
                    f"Fisher importance, {profile.n_samples} samples.")
            return importance_chart(profile.share("prefill"), profile.share("decode"), pruned), note

        def on_compute(model, k, use_auto, progress=gr.Progress(track_tqdm=True)):
            try:
                manager.compute_importance(manager.check_name(model))
            except (ValueError, ModelError, Busy) as err:
                raise gr.Error(str(err)) from None
            return show_importance(model, k, use_auto)

        for trigger in (depth.release, auto.change):
            trigger(show_importance, [model, depth, auto], [importance_plot, importance_note], api_visibility="private")
        for trigger in (model.change, demo.load):
            trigger(on_model, [model, depth, auto], [depth, importance_plot, importance_note], api_visibility="private")
        compute.click(on_compute, [model, depth, auto], [importance_plot, importance_note], api_name="importance",
                      concurrency_id="model", concurrency_limit=1)

        # `/compare`: the API form — (image, question, model, prune_layers, max_new_tokens) -> JSON
        api_prune = gr.Textbox("", visible=False, label="prune_layers (k, a fraction of the layers, or auto; empty: L/3)")
        api_result = gr.JSON(visible=False, label="comparison")
        api_button = gr.Button(visible=False)

        def on_compare(image, question, model, prune_layers, max_new_tokens):
            try:
                return compare_json(manager, image, question, model, prune_layers, max_new_tokens)
            except (ValueError, ModelError, Busy) as err:
                raise gr.Error(str(err)) from None

        api_button.click(on_compare, [image, question, model, api_prune, max_new], api_result, api_name="compare",
                         concurrency_id="model", concurrency_limit=1, preprocess=False)
    return demo


def asset_paths() -> list[str]:
    return [str(Path(zoo.assets_dir()).resolve())]
