"""A loaded model with its processor: inputs from (image, question) or a conversation, answered in any mode,
streamed, prepared once for several modes, or continued from a cached conversation."""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Iterator

import torch

from .chat import Conversation, PrefixCache, image_fingerprint
from .config import PopConfig, check_max_new_tokens, check_mode
from .families import detect_family
from .families.base import Prompt
from .generate import GenerationResult, StageClock, generate_choices
from .images import fit_image, load_image
from .pop import make_plan
from .results import Answer, Choice, Timings
from .sampling import SamplingParams
from .textstream import Piece, check_stop, local_decode


@dataclass
class PreparedPrompt:
    """One request's inputs, built once and shared by several runs (full vs POP on the same image): the processor
    ran once (`preprocess_s`); the vision encoder runs once, at the first run that needs it (`vision_s`), and every
    later run starts its language-model stages from the same embedded prompt."""

    inputs: dict
    preprocess_s: float = 0.0
    prompt: Prompt | None = None
    vision_s: float = 0.0


class Pipeline:
    """A loaded model with its processor (or tokenizer, for text models), answering in any mode."""

    def __init__(self, model, processor, name: str | None = None):
        self.model = model.eval()
        self.processor = processor
        self.adapter = detect_family(model)
        self.name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.eos_token_ids = self._eos_token_ids()
        self.auto_k: int | None = None  # set from an importance profile, for prune_layers="auto"
        self.prefix_cache = PrefixCache()  # conversations' caches, for follow-up questions
        self.timer = time.perf_counter  # the clock of `Timings` (benchmarks pass time.thread_time)
        #: a `pop_vlm.batch.BatchScheduler` when requests run concurrently (serving): their decode steps are batched
        self.scheduler = None

    def device_turn(self):
        """Hold the device for model work outside the generation loop, when requests run concurrently."""
        return self.scheduler.device_turn() if self.scheduler is not None else nullcontext()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def is_multimodal(self) -> bool:
        return self.adapter.is_multimodal

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    @property
    def max_image_pixels(self) -> int | None:
        """The most pixels the image processor keeps (larger images are downscaled before it)."""
        image_processor = getattr(self.processor, "image_processor", None)
        size = getattr(image_processor, "size", None) or {}
        if size.get("longest_edge") and "shortest_edge" in size:  # Qwen-VL: a pixel budget
            return int(size["longest_edge"])
        if size.get("height") and size.get("width"):  # fixed-size processors (Gemma-3, SigLIP)
            return int(size["height"] * size["width"] * 4)
        return None

    def _eos_token_ids(self) -> set[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            return set()
        return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}

    # ---- inputs -----------------------------------------------------------------------------------------------
    def build_inputs(self, image, question: str) -> dict:
        """Processor output for one (image, question) — the chat template with the image for VLMs, the text
        model's chat template if it has one, else the plain question."""
        if not isinstance(question, str):
            raise TypeError(f"the question must be a string, not {type(question).__name__}")
        if not question.strip():
            raise ValueError("the question is empty")
        content = ([{"type": "image", "image": image}] if image is not None else []) + [{"type": "text", "text": question}]
        return self.build_chat_inputs([{"role": "user", "content": content}])

    def build_chat_inputs(self, messages: list[dict]) -> dict:
        """Processor output for a conversation: messages with `role` and `content` (a string, or parts
        `{"type": "text", "text": ...}` and `{"type": "image", "image": <path, bytes, PIL, numpy>}`)."""
        if not messages:
            raise ValueError("the conversation has no messages")
        images, template_messages, texts = [], [], []
        for message in messages:
            role, content = message.get("role"), message.get("content")
            if role not in ("system", "user", "assistant"):
                raise ValueError(f"unknown message role {role!r}: use system, user or assistant")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
            out_parts = []
            for part in parts:
                if part.get("type") == "text":
                    part_text = str(part.get("text", ""))
                    out_parts.append({"type": "text", "text": part_text})
                    texts.append(part_text)
                elif part.get("type") == "image":
                    picture = load_image(part.get("image"))
                    if picture is None:
                        continue
                    if not self.is_multimodal:
                        raise ValueError(f"{self.name} is a text-only model; it cannot take an image")
                    images.append(fit_image(picture, self.max_image_pixels))
                    out_parts.append({"type": "image"})
                else:
                    raise ValueError(f"unknown content part type {part.get('type')!r}: use text or image")
            template_messages.append({"role": role, "content": out_parts})
        if not "".join(texts).strip():
            raise ValueError("the question is empty")
        if self.is_multimodal:
            text = self.processor.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=False)
            # the rendered template already holds every special token it wants (Gemma-3's starts with <bos>)
            inputs = self.processor(images=images or None, text=[text], return_tensors="pt", add_special_tokens=False)
        elif getattr(self.tokenizer, "chat_template", None):
            flat = [{"role": m["role"], "content": "".join(p["text"] for p in m["content"])} for m in template_messages]
            text = self.tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
            inputs = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        else:  # a base model: the plain text
            inputs = self.tokenizer("\n".join(t for t in texts if t), return_tensors="pt")
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def build_prompt_inputs(self, prompt: str) -> dict:
        """Processor output for a raw prompt: the text as given, no chat template (the tokenizer still adds the
        special tokens it always adds, such as a BOS token)."""
        if not isinstance(prompt, str):
            raise TypeError(f"the prompt must be a string, not {type(prompt).__name__}")
        if self.is_multimodal:
            inputs = self.processor(text=[prompt], return_tensors="pt")
        else:
            inputs = self.tokenizer(prompt, return_tensors="pt")
        if inputs["input_ids"].shape[-1] == 0:
            raise ValueError("the prompt is empty")
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    # ---- answering -------------------------------------------------------------------------------------------
    def answer(self, image, question: str, mode: str = "pop", pop: PopConfig | None = None, **kwargs) -> Answer:
        *_, answer = self.stream(image, question, mode=mode, pop=pop, **kwargs)
        return answer

    def stream(self, image, question: str, mode: str = "pop", pop: PopConfig | None = None, **kwargs) -> Iterator:
        """Yield text pieces as they are generated; the last item is the `Answer`."""
        check_mode(mode)
        start = self.timer()
        inputs = self.build_inputs(image, question)
        return self._stream(inputs, mode, pop, preprocess_s=self.timer() - start, **kwargs)

    def stream_chat(self, messages: list[dict], mode: str = "pop", pop: PopConfig | None = None, **kwargs) -> Iterator:
        """`stream` for a whole conversation (see `build_chat_inputs`)."""
        check_mode(mode)
        start = self.timer()
        inputs = self.build_chat_inputs(messages)
        return self._stream(inputs, mode, pop, preprocess_s=self.timer() - start, **kwargs)

    def prepare(self, image, question: str) -> PreparedPrompt:
        """Build the inputs of (image, question) once, for several runs: `stream_prepared` / `answer_prepared` in
        each mode then share the preprocessing and one vision-encoder pass, and report the same times for them."""
        start = self.timer()
        inputs = self.build_inputs(image, question)
        return PreparedPrompt(inputs, preprocess_s=self.timer() - start)

    def stream_prepared(self, prepared: PreparedPrompt, mode: str = "pop", pop: PopConfig | None = None,
                        **kwargs) -> Iterator:
        """`stream` for a `PreparedPrompt`: the vision encoder runs only if no earlier run of it has."""
        return self._stream(prepared.inputs, mode, pop, preprocess_s=prepared.preprocess_s, prepared=prepared,
                            **kwargs)

    def answer_prepared(self, prepared: PreparedPrompt, mode: str = "pop", pop: PopConfig | None = None,
                        **kwargs) -> Answer:
        *_, answer = self.stream_prepared(prepared, mode=mode, pop=pop, **kwargs)
        return answer

    def _embedded(self, prepared: PreparedPrompt) -> Prompt:
        """The prepared prompt through the vision encoder and the embedding, once."""
        if prepared.prompt is None:
            with self.device_turn(), torch.inference_mode():
                clock = StageClock(self.device, self.timer)
                prepared.prompt = self.adapter.encode(prepared.inputs)
            clock("vision")
            prepared.vision_s = clock.stages["vision"]
        return prepared.prompt

    def warm_up(self, modes=("full", "pop"), max_new_tokens: int = 2, image_side: int = 448) -> None:
        """One short request of each mode, so that the first real request does not pay one-time costs (lazy
        allocations, kernel selection for shapes like a real request's, the fused KV weights of the default k).
        VLMs get a grey image of `image_side`² pixels (resized to the processor's budget like any upload)."""
        image = None
        if self.is_multimodal:
            from PIL import Image

            image = Image.new("RGB", (image_side, image_side), (128, 128, 128))
        prepared = self.prepare(image, "Hello")
        for mode in modes:
            try:
                stream = self.stream_prepared(prepared, mode=mode, max_new_tokens=max_new_tokens)
            except ValueError:  # the default k does not fit this model (its requests will say so): nothing to warm
                continue
            for _ in stream:
                pass

    def stream_prompt(self, prompt: str, mode: str = "pop", pop: PopConfig | None = None, **kwargs) -> Iterator:
        """`stream` for a raw prompt, continued as written (see `build_prompt_inputs`)."""
        check_mode(mode)
        start = self.timer()
        inputs = self.build_prompt_inputs(prompt)
        return self._stream(inputs, mode, pop, preprocess_s=self.timer() - start, **kwargs)

    def generate(self, inputs: dict, mode: str = "pop", pop: PopConfig | None = None, **kwargs) -> Answer:
        """Answer for a processor's output (already built inputs)."""
        inputs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        *_, answer = self._stream(inputs, mode, pop, **kwargs)
        return answer

    @property
    def context_length(self) -> int | None:
        return getattr(self.adapter.config, "max_position_embeddings", None)

    def chat(self, image=None, mode: str = "pop", pop: PopConfig | None = None, **generation) -> Conversation:
        """A conversation (about `image`, if given): each `ask` reuses the cache of the turns before it."""
        check_mode(mode)
        return Conversation(self, image=image, mode=mode, pop=pop, **generation)

    def _stream(self, inputs, mode, pop, *, preprocess_s: float = 0.0, max_new_tokens: int = 128,
                do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                seed: int | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                stop=None, n: int = 1, logprobs: bool = False, top_logprobs: int = 0, output_scores: bool = False,
                time_limit_s: float | None = None, reuse_prefix: bool = False, prepared: PreparedPrompt | None = None,
                ignore_eos: bool = False):
        """Check everything that can be checked before any model work, then return the generator.

        `stop`: a string or strings that end an answer (not included in its text). `n`: how many answers, each
        its own sample of the same prefilled prompt (streamed one after the other; each `Piece` names its
        choice). `logprobs`: keep each token's log-probability and `top_logprobs` alternatives.
        With `reuse_prefix`, a cached conversation whose tokens begin this prompt (same images, mode and POP
        settings) is continued: only the new tokens are prefilled, and this turn is cached in turn. With `prepared`,
        the vision encoder's work is shared with the prepared prompt's other runs. `ignore_eos` decodes all
        `max_new_tokens` (benchmarks of fixed answer length)."""
        check_mode(mode)
        pop = pop if pop is not None else PopConfig()
        sampling = SamplingParams(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                  presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
        check_max_new_tokens(max_new_tokens)
        stop = check_stop(stop)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
            raise ValueError(f"top_logprobs must be a non-negative integer, got {top_logprobs!r}")
        plan = make_plan(self.adapter, mode, pop, self.auto_k)  # a bad k or a protected layer fails here
        n_prompt = int(inputs["input_ids"].shape[-1])
        if self.context_length and n_prompt + max_new_tokens > self.context_length:
            raise ValueError(
                f"the prompt has {n_prompt} tokens; with max_new_tokens={max_new_tokens} it exceeds the model's "
                f"context of {self.context_length} tokens"
            )
        key = None
        if reuse_prefix and prepared is not None:
            raise ValueError("a prepared prompt is not continued from a cached conversation: use one or the other")
        if reuse_prefix:
            key = (mode, plan.pruned, plan.kv_projection, plan.boundary, pop.full_tail,
                   image_fingerprint(inputs, self.adapter.image_input_keys))
        options = dict(mode=mode, pop=pop, n=n, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                       top_logprobs=top_logprobs if logprobs else None, output_scores=output_scores,
                       time_limit_s=time_limit_s, eos_token_ids=set() if ignore_eos else self.eos_token_ids)
        return self._generate_text(inputs, options, preprocess_s, key, prepared)

    def _generate_text(self, inputs, options: dict, preprocess_s: float, prefix_key, prepared=None):
        result = GenerationResult(timings=Timings(preprocess_s=preprocess_s))
        prompt_ids = inputs["input_ids"][0].tolist()
        cache, start, prompt = None, 0, None
        if prefix_key is not None:
            cache, start = self.prefix_cache.take(prefix_key, prompt_ids) or (None, 0)
        if prepared is not None:
            prompt = self._embedded(prepared)
            result.timings.vision_s = prepared.vision_s
        result.timings.n_cached_tokens = start
        tokens = generate_choices(
            self.adapter, inputs, decode=self.decode, result=result,
            auto_k=self.auto_k, cache=cache, start=start, prompt=prompt, timer=self.timer, batch=self.scheduler,
            **options,
        )
        shown: dict[int, int] = {}  # per choice: characters and tokens already streamed

        def pieces(index: int, final: bool = False):
            choice = result.choices[index]
            text = choice.text.visible(final)
            chars, covered = shown.get(index, (0, 0))
            if len(text) > chars:
                now_covered = choice.text.tokens_covering(len(text))
                logprobs = choice.logprobs[covered:now_covered] if choice.logprobs is not None else None
                shown[index] = (len(text), now_covered)
                yield Piece(text[chars:], index, logprobs)

        current = 0
        for index, _ in tokens:
            if index != current:  # the previous choice is done: what it held back is final
                yield from pieces(current, final=True)
                current = index
            yield from pieces(index)
        yield from pieces(current, final=True)
        last = result.choices[-1]
        if prefix_key is not None and last.token_ids:
            self.prefix_cache.put(prefix_key, prompt_ids + last.token_ids[:-1], result.cache)
        choices = [self._choice(c) for c in result.choices]
        first = choices[0]
        yield Answer(
            text=first.text,
            token_ids=list(first.token_ids),
            mode=options["mode"],
            pruned_layers=list(result.plan.pruned),
            n_prompt_tokens=result.prompt.length,
            n_image_tokens=result.prompt.n_image_tokens,
            timings=result.timings,
            finish_reason=first.finish_reason,
            scores=first.scores,
            logprobs=first.logprobs,
            choices=choices,
        )

    @staticmethod
    def _choice(choice) -> Choice:
        text = choice.text.visible(final=True)
        logprobs = choice.logprobs[: choice.text.tokens_covering(len(text))] if choice.logprobs is not None else None
        return Choice(choice.index, text, list(choice.token_ids), choice.finish_reason, logprobs, choice.scores)

    @local_decode
    def decode(self, token_ids) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (for log-probabilities)."""
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    # ---- importance ------------------------------------------------------------------------------------------
    def importance(self, samples=None, *, budget: float | None = None, **kwargs):
        """Virtual-gate Fisher importance per stage and Block Influence (see `pop_vlm.importance`).

        samples: texts, (image, question[, answer]) tuples, or None for passages of CPython's pydoc topics.
        Sets `self.auto_k` to the profile's `auto_k(budget)` (default 2 % of the prefill importance), which
        `PopConfig(prune_layers="auto")` then uses. Returns the `LayerImportance`.
        """
        from .importance import DEFAULT_BUDGET, compute_importance

        budget = DEFAULT_BUDGET if budget is None else budget
        profile = compute_importance(self, samples, budget=budget, **kwargs)
        self.auto_k = profile.auto_k(budget)
        return profile
