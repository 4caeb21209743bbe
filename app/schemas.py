"""The HTTP API's request and response bodies, declared once: FastAPI validates requests with them and
`/openapi.json` describes them. Numbers, booleans and strings are strict (no "3" for 3, no true for 1); unknown
fields are refused, as OpenAI refuses them."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pop_vlm.config import MODES, parse_prune_layers


def _number(low: float, high: float, *, above: bool = False, doc: str = ""):
    bound = {"gt": low} if above else {"ge": low}
    return Annotated[float, Field(strict=True, le=high, description=doc, **bound)]


def _integer(low: int, high: int | None = None, doc: str = ""):
    return Annotated[int, Field(strict=True, ge=low, le=high, description=doc)]


Text = Annotated[str, Field(strict=True)]
Flag = Annotated[bool, Field(strict=True)]
Temperature = _number(0, 2, doc="0 is greedy decoding")
TopP = _number(0, 1, above=True)
Penalty = _number(-2, 2, doc="OpenAI's presence/frequency penalty, applied in the sampler")
Seed = _integer(-(2**63), 2**63 - 1, doc="makes sampling repeatable")
MaxTokens = _integer(1, doc="at most the server's --max-new-tokens-cap")
Choices = _integer(1, 8, doc="how many answers; the prompt is prefilled once for all of them")
StopString = Annotated[str, Field(strict=True, min_length=1)]
StopStrings = Union[StopString, Annotated[list[StopString], Field(min_length=1, max_length=4)]]

#: OpenAI request fields this server does not implement: refused (when set to anything but null or empty) rather
#: than ignored, since ignoring them would give a client a wrong answer with no error
UNSUPPORTED = {
    "tools": "tool calling is not supported by this server",
    "tool_choice": "tool calling is not supported by this server",
    "functions": "function calling is not supported by this server",
    "function_call": "function calling is not supported by this server",
    "parallel_tool_calls": "tool calling is not supported by this server",
    "logit_bias": "logit_bias is not supported by this server",
    "audio": "audio output is not supported by this server",
    "modalities": "only text output is supported by this server",
    "prediction": "predicted outputs are not supported by this server",
    "suffix": "suffix (insertion) is not supported by this server",
    "best_of": "best_of is not supported by this server: use n",
}


def refuse_unsupported(body: Any) -> Any:
    """Drop unsupported fields that are null or empty (clients send those meaning "not used"); refuse the rest."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for name, why in UNSUPPORTED.items():
        if name not in body:
            continue
        value = body.pop(name)
        if value is None or value == [] or value == {} or (name == "best_of" and value == 1):
            continue
        raise PydanticCustomError("unsupported", "{message}", {"param": name, "message": f"{why} ('{name}')"})
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        raise PydanticCustomError("unsupported", "{message}", {
            "param": "response_format",
            "message": f"response_format {response_format.get('type')!r} is not supported by this server: it does "
                       "not constrain its output (only {'type': 'text'})"})
    return body


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- requests -------------------------------------------------------------------------------------------------
class PopOptions(Strict):
    """How the answer is computed (this server's extension)."""

    mode: Literal[MODES] = Field("pop", description="pop: Prefill-Only Pruning; full: the plain model; static: "
                                                   "the same layers removed in both stages")
    prune_layers: Union[Annotated[int, Field(strict=True)], Annotated[float, Field(strict=True)], Text, None] = Field(
        None, description="layers the prefill skips: a count, a fraction of the layers, or 'auto'; default L/3")

    @field_validator("prune_layers", mode="before")
    @classmethod
    def _prune_layers(cls, value):
        try:
            return parse_prune_layers(value) if value is not None else None
        except ValueError as err:
            raise PydanticCustomError("invalid", str(err)) from None


class StreamOptions(Strict):
    include_usage: Optional[Flag] = Field(None, description="send usage in a last chunk with no choices")


class ImageURL(Strict):
    url: Text = Field(description="a data: URL (base64); http(s) only when the server allows remote images")
    detail: Optional[Literal["auto", "low", "high"]] = None


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: Union[ImageURL, Text]


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[Text, list[ContentPart]]
    name: Optional[Text] = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value):
        if not isinstance(value, (str, list)):
            raise PydanticCustomError("invalid", "must be a string or a list of parts")
        return value


class Sampling(Strict):
    """Fields common to both endpoints."""

    model: Optional[Text] = Field(None, description="a listed model; empty or absent: the server's default")
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    seed: Optional[Seed] = None
    n: Optional[Choices] = None
    stop: Optional[StopStrings] = Field(None, description="up to 4 strings; the answer ends before the first one")
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    stream: Optional[Flag] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[Text] = None
    pop: Optional[PopOptions] = None
    ignore_eos: Optional[Flag] = Field(None, description="decode exactly max_tokens tokens, past the end-of-turn "
                                                         "token (benchmarks of a fixed answer length; vLLM's name)")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body):
        return refuse_unsupported(body)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("invalid", "{message}", {
                "param": "stream_options", "message": "stream_options is only allowed when stream is true"})
        return self


class ChatCompletionRequest(Sampling):
    """OpenAI's chat completion request. Refused with 400: tools, tool_choice, functions, function_call,
    parallel_tool_calls, a non-empty logit_bias, response_format other than text, and unknown fields."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[MaxTokens] = None
    max_completion_tokens: Optional[MaxTokens] = None
    logprobs: Optional[Flag] = Field(None, description="log-probabilities of the answer's tokens")
    top_logprobs: Optional[_integer(0, 20)] = Field(None, description="alternatives per token; needs logprobs")
    response_format: Optional[dict[Literal["type"], Literal["text"]]] = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("invalid", "{message}", {
                "param": "top_logprobs", "message": "top_logprobs needs logprobs: true"})
        return self


class CompletionRequest(Sampling):
    """OpenAI's legacy completion request: the prompt as given, no chat template. `echo` is refused: the
    log-probabilities of prompt tokens would, under POP, come from the pruned layer stack, not the model."""

    prompt: Union[Annotated[str, Field(strict=True)], Annotated[list[Text], Field(min_length=1, max_length=16)]]
    max_tokens: Optional[MaxTokens] = Field(None, description="default 16, as OpenAI's")
    logprobs: Optional[_integer(0, 5)] = Field(None, description="the chosen token's and this many alternatives'")
    echo: Optional[Flag] = Field(None, description="only false: prompt tokens are not scored")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        if value:
            raise PydanticCustomError("unsupported", "echo is not supported: under POP the prompt's tokens run "
                                                     "through the pruned layers only, so their log-probabilities "
                                                     "would not be the model's")
        return value


# ---- responses ------------------------------------------------------------------------------------------------
class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PopInfo(BaseModel):
    mode: str
    pruned_layers: list[int]
    n_image_tokens: int
    timed_out: bool


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]]


class TokenLogprobBody(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: Optional[list[TokenLogprobBody]]
    refusal: Optional[list[TokenLogprobBody]] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str]


FinishReason = Literal["stop", "length"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: Optional[ChatLogprobs]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: dict[str, float] = Field(description="where the time to first token went (seconds), and decode speed")
    pop: PopInfo


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: Optional[FinishReason]
    logprobs: Optional[ChatLogprobs]


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (`data: {...}`; the stream ends with `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    timings: Optional[dict[str, float]] = None
    pop: Optional[PopInfo] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Optional[FinishReason]
    logprobs: Optional[CompletionLogprobs]


class Completion(BaseModel):
    """A legacy completion, and (with `object` "text_completion", the same fields) each streamed chunk."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    timings: Optional[dict[str, float]] = None
    pop: Optional[PopInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    error: ErrorBody
