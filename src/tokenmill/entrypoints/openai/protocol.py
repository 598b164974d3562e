"""Request models of the OpenAI-compatible API, and the one way request bodies are parsed.

Owns what a valid body is. Models are strict (``"5"`` is not an integer, ``1.5`` is not
``n``) and forbid unknown fields, so a feature tokenmill does not implement is a clear 400
naming the field rather than something silently ignored. Fields OpenAI defines but
tokenmill cannot honour (functions, suffix) are declared only so the
rejection can say why. Bodies are decoded here, before pydantic sees them: wrong content
type, invalid UTF-8, lone surrogates and non-object JSON all fail with OpenAI's error shape.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from tokenmill.core.cache_salt import CACHE_SALT_ERROR
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.structured_params import StructuredOutputsParams
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.errors import InvalidRequestError

_INT32_MAX = 2**31 - 1

ModelT = TypeVar("ModelT", bound=BaseModel)

_WHOLE_MESSAGE = "tokenmill_whole_message"
"""Error type of a field check whose message is the whole answer (it names the field)."""


def _check_cache_salt(value: Any) -> Any:
    """vLLM's check, before any type check, so a number or ``""`` gets vLLM's message."""
    if value is not None and (not isinstance(value, str) or not value):
        raise PydanticCustomError(_WHOLE_MESSAGE, CACHE_SALT_ERROR)
    return value


CacheSalt = Annotated[str | None, BeforeValidator(_check_cache_salt)]
"""vLLM's ``cache_salt`` request field: only requests with the same salt (and, on a server
with API keys, the same key) reuse each other's prefix-cache blocks."""


class StrictModel(BaseModel):
    """Base of every request model: strict types, unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", strict=True)


class RequestBody(StrictModel):
    """Base of every body ``parse_request`` takes: the served model, and its own checks."""

    model: str | None = None
    """Served model name; defaults to the first one."""

    def check(self) -> None:
        """Reject what tokenmill cannot honour, naming the field (nothing by default)."""


class StreamOptions(StrictModel):
    include_usage: bool = False
    """Send a final chunk with the request's usage (and empty choices) before [DONE]."""
    continuous_usage_stats: bool = False
    """vLLM extension: put the running usage in every chunk."""


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StructuredOutputsRequest(StrictModel):
    """vLLM's ``structured_outputs``: exactly one constraint on the output."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's older request fields, each one kind of structured output."""


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(StrictModel):
    name: str
    arguments: str
    """The arguments as JSON text, as the model wrote them."""


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant turn's tool calls."""
    tool_call_id: str | None = None
    """A tool turn: the call this result answers."""


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object."""
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class SamplingFields(RequestBody):
    """Fields shared by completions and chat: OpenAI's plus the vLLM extras."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """Accepted for compatibility; not used."""
    logit_bias: dict[str, float] | None = None
    """Token id (as a string) -> bias in [-100, 100], added to its logit before sampling."""
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    """Only true is accepted: the tokenizer's decoder decides that spacing."""
    priority: int = 0
    """Lower runs first when the server uses ``--scheduling-policy priority``."""
    cache_salt: CacheSalt = None
    """vLLM extension: prefix-cache blocks are reused only between requests with the same salt
    (random, secret and long, e.g. 43 base64 characters, to keep other users from guessing it)."""
    return_tokens_as_token_ids: bool = False
    """Name logprob tokens ``token_id:N`` instead of their text, as vLLM does."""
    return_token_ids: bool = False
    """vLLM extension: add the prompt's token ids (``prompt_token_ids``) and each choice's (``token_ids``)."""
    use_beam_search: bool = False
    """vLLM extension: beam search (width ``best_of`` or ``n``), the n best beams returned at the end."""
    length_penalty: float = 1.0
    """Beam search: a finished beam scores sum(logprobs) / (generated tokens ** length_penalty)."""
    early_stopping: bool | Literal["never"] = False
    """Beam search: stop once the beam width has finished (true), when no beam can improve (false), or "never"."""
    # Structured outputs: vLLM's field, its older guided_* fields (response_format is OpenAI's).
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: ResponseFormat | None = None

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str]:
        """The one output constraint this body asks for, and the field that asked for it."""
        given: list[tuple[StructuredOutputsParams, str]] = []
        if self.structured_outputs is not None:
            values = self.structured_outputs.model_dump(exclude_none=True, by_alias=True)
            given.append((StructuredOutputsParams(**values), "structured_outputs"))
        for name, kind in _GUIDED_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                given.append((StructuredOutputsParams(**{kind: value}), name))
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append((StructuredOutputsParams(json_object=True), "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            given.append((_json_schema_format(fmt.json_schema), "response_format"))
        if len(given) > 1:
            names = ", ".join(name for _, name in given)
            raise InvalidRequestError(
                f"give at most one output constraint; got {names}", param=given[1][1]
            )
        return given[0] if given else (None, "structured_outputs")

    def check(self) -> None:
        """Reject what tokenmill cannot honour, naming the field."""
        if not -_INT32_MAX <= self.priority <= _INT32_MAX:
            raise InvalidRequestError("priority must fit in 32 bits", param="priority")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        if not self.spaces_between_special_tokens:
            raise InvalidRequestError(
                "spaces_between_special_tokens=false is not supported: the tokenizer's decoder decides the "
                "spacing between special tokens",
                param="spaces_between_special_tokens",
            )

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The engine's SamplingParams; its validation errors name the offending field."""
        values: dict[str, Any] = {
            "n": self.n,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k is None else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": 1.0
            if self.repetition_penalty is None
            else self.repetition_penalty,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "use_beam_search": self.use_beam_search,
            "length_penalty": self.length_penalty,
            "early_stopping": self.early_stopping,
            "structured_outputs": self.structured_outputs_params()[0],
            "logit_bias": self.logit_bias,
        }
        return SamplingParams(**values)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


Prompt = str | list[int] | list[list[int]] | list[str]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: Prompt
    """A string, a list of strings, token ids, or a list of token-id lists."""
    suffix: str | None = None
    max_tokens: int | None = 16
    """400 when the prompt plus it exceed the context (as vLLM); null: all the context left."""
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True

    def check(self) -> None:
        super().check()
        if self.suffix is not None:
            raise InvalidRequestError("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n and not self.use_beam_search:
            raise InvalidRequestError(
                "best_of other than n is only supported with use_beam_search", param="best_of"
            )
        prompts = self.prompt if isinstance(self.prompt, list) else [self.prompt]
        if not prompts:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        for p in prompts:
            if isinstance(p, (str, list)) and len(p) == 0:
                raise InvalidRequestError("prompt must not be empty", param="prompt")

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """As for chat, plus ``best_of`` (the beam width under beam search)."""
        params = super().sampling_params(max_tokens, logprobs, prompt_logprobs)
        return params if self.best_of is None else params.clone(best_of=self.best_of)

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts as a list: each a string or a token-id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)  # type: ignore[arg-type]


class ChatTemplateFields(StrictModel):
    """Chat-template inputs shared by chat completions and tokenize."""

    add_generation_prompt: bool = True
    chat_template: str | None = None
    """A template source; only honoured with ``--trust-request-chat-template``."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the template (e.g. ``enable_thinking``); ones the server sets are refused."""


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    """Deprecated by OpenAI in favour of max_completion_tokens; null means the context left."""
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: 'auto' when tools are given (needs --enable-auto-tool-choice), else 'none'."""
    parallel_tool_calls: bool | None = None
    prompt_logprobs: int | None = None
    """vLLM extension: log-probabilities of the prompt tokens (top-level ``prompt_logprobs``)."""
    functions: list[Any] | None = None
    function_call: Any | None = None

    def check(self) -> None:
        super().check()
        for name in ("functions", "function_call"):  # deprecated by OpenAI: use tools
            if getattr(self, name) is not None:
                raise InvalidRequestError(
                    f"{name} is not supported; use tools and tool_choice", param=name
                )
        if self.tools is not None and not self.tools:
            raise InvalidRequestError("tools must not be empty", param="tools")
        first_with_name: dict[str, int] = {}
        for i, tool in enumerate(self.tools or []):
            name = tool.function.name
            if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
                raise InvalidRequestError(
                    "function names must be 1-64 letters, digits, '_' or '-'",
                    param=f"tools.{i}.function.name",
                )
            if name in first_with_name:  # a call, or a named tool_choice, would be ambiguous
                raise InvalidRequestError(
                    f"function name {name!r} is also tools[{first_with_name[name]}]'s; "
                    "names must be unique",
                    param=f"tools.{i}.function.name",
                )
            first_with_name[name] = i
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true", param="top_logprobs"
            )
        call_ids: set[str] = set()
        for i, message in enumerate(self.messages):
            if message.content is None and message.role != "assistant":
                raise InvalidRequestError(
                    f"messages[{i}].content is required", param=f"messages.{i}.content"
                )
            if message.role == "tool" and message.tool_call_id is None:
                raise InvalidRequestError(
                    f"messages[{i}].tool_call_id is required for a tool message",
                    param=f"messages.{i}.tool_call_id",
                )
            if message.role == "tool" and message.tool_call_id not in call_ids:
                raise InvalidRequestError(  # as OpenAI: a result answers an earlier call
                    f"messages[{i}].tool_call_id {message.tool_call_id!r} answers no tool call "
                    "of an earlier assistant message",
                    param=f"messages.{i}.tool_call_id",
                )
            call_ids.update(call.id for call in message.tool_calls or ())

    def max_new_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class TokenizeRequest(ChatTemplateFields):
    """``POST /tokenize``: either ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: true for a prompt, false for messages (the template writes them)."""
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
        if self.messages is not None and not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")


class DetokenizeRequest(StrictModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


def _json_schema_format(value: dict[str, Any] | None) -> StructuredOutputsParams:
    """OpenAI's ``response_format.json_schema``: ``{name, description?, schema?, strict?}``."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise InvalidRequestError(
            "response_format.json_schema must be an object with a 'name'",
            param="response_format.json_schema",
        )
    unknown = set(value) - {"name", "description", "schema", "strict"}
    if unknown:
        raise InvalidRequestError(
            f"unknown field(s) in response_format.json_schema: {sorted(unknown)}",
            param="response_format.json_schema",
        )
    schema = value.get("schema", {})
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            "response_format.json_schema.schema must be a JSON object",
            param="response_format.json_schema.schema",
        )
    return StructuredOutputsParams(json=schema)


# ---- body parsing ----------------------------------------------------------------------------
_TYPE_TAGS = {
    "str",
    "int",
    "float",
    "bool",
    "list",
    "dict",
    "none",
    "is-instance",
    "function-after",
}


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]
    return ".".join(parts) or None


def _check_strings(value: Any, path: str) -> None:
    """Reject lone surrogates (valid JSON escapes, but not text) anywhere in the body."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequestError(
                    f"{where or 'body'} contains invalid Unicode (a lone surrogate)",
                    param=where or None,
                ) from None
        elif isinstance(item, list):
            stack.extend((v, f"{where}.{i}" if where else str(i)) for i, v in enumerate(item))
        elif isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str) or any(0xD800 <= ord(c) <= 0xDFFF for c in k):
                    raise InvalidRequestError(
                        "a field name contains invalid Unicode", param=where or None
                    )
                stack.append((v, f"{where}.{k}" if where else k))


def decode_json_object(raw: bytes, content_type: str | None) -> dict[str, Any]:
    """The body as a JSON object, or an APIError saying exactly what is wrong with it."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(
            415,
            "the request body must be JSON (Content-Type: application/json)",
            code="unsupported_media_type",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8", code="invalid_json") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # ValueError also covers integers over the digit limit
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    _check_strings(data, "")
    return data


def validate_model(model_cls: type[ModelT], data: dict[str, Any]) -> ModelT:
    """Validate a decoded body; the first problem becomes a 400 naming its field."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        param = _param_from_loc(tuple(first.get("loc", ())))
        if first.get("type") == _WHOLE_MESSAGE:
            message = first["msg"]
        elif first.get("type") == "extra_forbidden":
            message = f"unknown or unsupported field {param!r}"
        elif first.get("type") == "missing":
            message = f"{param} is required"
        else:
            message = (
                f"{param}: {first.get('msg', 'invalid value')}"
                if param
                else first.get("msg", "invalid body")
            )
        raise InvalidRequestError(message, param=param) from None
