"""The Gradio page: one question, answered by the full model and by POP side by side."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
from pop_vlm import PopConfig, zoo

from .charts import importance_chart, ttft_chart
from .compare import (chat_timing_markdown, chat_turn, compare_json, comparison, speedup_markdown,
                      timing_markdown, uploaded_path)
from .models import Busy, ModelError, ModelManager

def default_depth(manager: ModelManager) -> int:
    """The depth slider's first value: k = L/3 of the default model, from its config (the weights may still be
    loading); 0 when the config cannot be read here."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(zoo.resolve(manager.check_name(None)))
    except Exception:  # noqa: BLE001 - the slider is refitted once the model has loaded (on_model)
        return 0
    return PopConfig().num_pruned(getattr(config, "text_config", config).num_hidden_layers)


#: which examples each kind of model can answer: a bundled shapes model knows only its canvases, a text model
#: takes no image, a general VLM answers about photos (and canvases too)
EXAMPLE_TASKS = {"shapes": ("shapes",), "text": ("text",), "photo": ("photo", "shapes")}


def example_kind(manager: ModelManager, name: str | None) -> str:
    """"shapes", "text" or "photo": decided from the name (bundled, text model) or, once loaded, the pipeline."""
    from .models import TEXT_MODELS

    name = name or manager.default
    if name in zoo.BUNDLED:
        return "shapes"
    if name in TEXT_MODELS:
        return "text"
    loaded = manager.loaded(name)
    return "text" if loaded is not None and not loaded.is_multimodal else "photo"


def examples(kind: str = "photo") -> list[list]:
    """Clickable (image, question) examples that fit a kind of model (assets/qa/examples.jsonl)."""
    listing = zoo.assets_dir() / "qa" / "examples.jsonl"
    if not listing.is_file():
        return []
    rows = [json.loads(line) for line in listing.read_text().splitlines() if line.strip()]
    out = []
    for row in rows:
        if row.get("task", "photo") not in EXAMPLE_TASKS[kind]:
            continue
        image = zoo.assets_dir() / row["image"] if row.get("image") else None
        if image is None or image.is_file():
            out.append([str(image) if image else None, row["question"]])
    return out


def build_demo(manager: ModelManager) -> gr.Blocks:
    with gr.Blocks(title="pop-vlm: Prefill-Only Pruning") as demo:
        gr.Markdown("# pop-vlm — Prefill-Only Pruning\nThe prompt (and the image's tokens) run through the first "
                    "L−k layers only; the answer is decoded with the full model. Same question, both ways:")
        with gr.Tab("Full vs POP"), gr.Row():
            controls = compare_controls(manager)
            results = compare_results()
        with gr.Tab("Chat about an image"):
            chat = chat_tab()
        wire_compare(manager, controls, results)
        wire_importance(manager, demo, controls, results)
        wire_chat(manager, controls, chat)
        wire_compare_api(manager, controls)
    return demo


def compare_controls(manager: ModelManager) -> SimpleNamespace:
    """The left column: image, question, model, POP depth, options."""
    c = SimpleNamespace()
    with gr.Column(scale=1):
        c.image = gr.Image(type="filepath", label="Image", elem_id="image", height=280)
        c.question = gr.Textbox(label="Question", placeholder="What is in the picture?", elem_id="question")
        c.model = gr.Dropdown(manager.choices(), value=manager.default, label="Model",
                              allow_custom_value=manager.allow_any,
                              info=("the served models, a hub id or a local folder" if manager.allow_any
                                    else "the models this server offers"),
                              elem_id="model")
        with gr.Row():
            c.depth = gr.Slider(0, 64, value=default_depth(manager), step=1,
                                label="POP depth k (layers skipped in prefill)", elem_id="depth")
            c.auto = gr.Checkbox(label="auto k", value=False)
        c.max_new = gr.Slider(1, 256, value=32, step=1, label="max new tokens")
        c.repeat = gr.Checkbox(label="repeat 3× and take the median (steadier timings)", value=False, elem_id="repeat")
        with gr.Accordion("Advanced", open=False):
            c.no_kv = gr.Checkbox(label="ablation: no KV projection for skipped layers")
            c.no_boundary = gr.Checkbox(label="ablation: no boundary step (first token from pruned stack)")
            c.with_static = gr.Checkbox(label="also run the static baseline (the same layers removed everywhere)")
        c.run = gr.Button("Ask both", variant="primary", elem_id="run")
        c.examples = gr.Examples(examples(example_kind(manager, manager.default)) or [[None, "What is in the picture?"]],
                                 inputs=[c.image, c.question], label="Examples for this model")
    c.history, c.turn = gr.State([]), gr.State(0)
    return c


def compare_results() -> SimpleNamespace:
    """The right column: the speedups, each side's answer and timings, the charts."""
    r = SimpleNamespace()
    with gr.Column(scale=2):
        r.speedup = gr.Markdown(label="speedup", elem_id="speedup")
        with gr.Row():
            for mode, title in (("full", "Full model"), ("pop", "POP"), ("static", "Static removal")):
                with gr.Column(visible=mode != "static") as column:
                    gr.Markdown(f"### {title}")
                    owner = {"full": "full model's", "pop": "POP's", "static": "static removal's"}[mode]
                    setattr(r, f"{mode}_text", gr.Textbox(label=f"{owner} answer", lines=4, elem_id=f"{mode}-answer"))
                    setattr(r, f"{mode}_timing", gr.Markdown(label=f"{owner} timings", elem_id=f"{mode}-timing"))
            r.static_column = column
        r.chart = gr.Plot(label="time to first token", elem_id="ttft-chart")
        with gr.Accordion("Layer importance", open=True):
            r.importance_plot = gr.Plot(label="prefill vs decode importance", elem_id="importance")
            r.importance_note = gr.Markdown(label="importance profile")
            r.compute = gr.Button("Compute importance for this model")
    return r


def chat_tab() -> SimpleNamespace:
    t = SimpleNamespace()
    gr.Markdown("Follow-up questions reuse the conversation's cache (the image's vision features and the KV "
                "of everything said before): only the new question is prefilled.")
    with gr.Row():
        with gr.Column(scale=1):
            t.image = gr.Image(type="filepath", label="Image", elem_id="chat-image", height=240)
            t.mode = gr.Radio(["pop", "full"], value="pop", label="mode")
            t.new_chat = gr.Button("New conversation")
        with gr.Column(scale=2):
            t.chatbot = gr.Chatbot(label="conversation", elem_id="chatbot", height=320)
            t.input = gr.Textbox(label="Question", elem_id="chat-question", placeholder="Ask about the image")
            t.timing = gr.Markdown(label="timings", elem_id="chat-timing")
    t.conversation = gr.State([])
    return t


def model_runs(manager: ModelManager) -> dict:
    """Page events that run the model: as many at once as the batch takes (their decode steps are batched)."""
    return dict(concurrency_id="model", concurrency_limit=manager.limits.max_batch_size)


def prune_value(k, use_auto):
    return "auto" if use_auto else int(k)


def wire_compare(manager: ModelManager, c: SimpleNamespace, r: SimpleNamespace) -> None:
    """'Ask both': full and POP (and static) on the same request, streamed side by side."""

    def on_run(image, question, model, k, use_auto, max_new, no_kv, no_boundary, with_static, repeat, history, turn):
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

    outputs = [r.full_text, r.pop_text, r.static_text, r.full_timing, r.pop_timing, r.static_timing, r.speedup,
               r.chart, c.history, c.turn, r.static_column]
    inputs = [c.image, c.question, c.model, c.depth, c.auto, c.max_new, c.no_kv, c.no_boundary, c.with_static,
              c.repeat, c.history, c.turn]
    c.run.click(on_run, inputs, outputs, api_name="ask", **model_runs(manager), preprocess=False)
    c.question.submit(on_run, inputs, outputs, api_visibility="private", **model_runs(manager),
                      preprocess=False)


def wire_importance(manager: ModelManager, demo, c: SimpleNamespace, r: SimpleNamespace) -> None:
    """The depth slider fitted to the model, and its importance chart (shipped, cached, or computed on demand)."""

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

    def on_model(model, k, use_auto):
        """Fit the depth slider to the model (default k = L/3) and show its importance profile."""
        try:
            pipe = manager.get(model)
        except (ValueError, ModelError) as err:
            return gr.update(), None, str(err), gr.update()
        value = PopConfig().num_pruned(pipe.num_layers)
        fitting = gr.Dataset(samples=examples(example_kind(manager, model)))
        return (gr.update(maximum=pipe.num_layers - 1, value=value), *show_importance(model, value, use_auto), fitting)

    def on_compute(model, k, use_auto, progress=gr.Progress(track_tqdm=True)):
        try:
            manager.compute_importance(manager.check_name(model))
        except (ValueError, ModelError, Busy) as err:
            raise gr.Error(str(err)) from None
        return show_importance(model, k, use_auto)

    chart = [r.importance_plot, r.importance_note]
    for trigger in (c.depth.release, c.auto.change):
        trigger(show_importance, [c.model, c.depth, c.auto], chart, api_visibility="private")
    for trigger in (c.model.change, demo.load):
        trigger(on_model, [c.model, c.depth, c.auto], [c.depth, *chart, c.examples.dataset], api_visibility="private")
    r.compute.click(on_compute, [c.model, c.depth, c.auto], chart, api_name="importance", **model_runs(manager))


def wire_chat(manager: ModelManager, c: SimpleNamespace, t: SimpleNamespace) -> None:
    """The chat tab: each turn continues the conversation's cache."""

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

    inputs = [t.image, t.input, c.model, t.mode, c.depth, c.auto, c.max_new, t.conversation, t.chatbot]
    t.input.submit(on_chat, inputs, [t.chatbot, t.input, t.conversation, t.timing], api_name="chat",
                   **model_runs(manager), preprocess=False)
    reset = [t.chatbot, t.conversation, t.timing]
    t.new_chat.click(lambda: ([], [], ""), None, reset, api_visibility="private")
    t.image.change(lambda: ([], [], ""), None, reset, api_visibility="private")


def wire_compare_api(manager: ModelManager, c: SimpleNamespace) -> None:
    """`/compare`: the API form — (image, question, model, prune_layers, max_new_tokens) -> JSON."""
    prune = gr.Textbox("", visible=False, label="prune_layers (k, a fraction of the layers, or auto; empty: L/3)")
    result = gr.JSON(visible=False, label="comparison")
    button = gr.Button(visible=False)

    def on_compare(image, question, model, prune_layers, max_new_tokens):
        try:
            return compare_json(manager, image, question, model, prune_layers, max_new_tokens)
        except (ValueError, ModelError, Busy) as err:
            raise gr.Error(str(err)) from None

    button.click(on_compare, [c.image, c.question, c.model, prune, c.max_new], result, api_name="compare",
                 **model_runs(manager), preprocess=False)


def asset_paths() -> list[str]:
    return [str(Path(zoo.assets_dir()).resolve())]
