"""Request models of the OpenAI-compatible API, validated at the boundary.

Every model forbids fields it does not declare: a field we do not support is a 400 that
names it, never silently ignored.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema (the schema itself under "schema")."""

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: one of json (a schema), json_object, regex, choice,
    grammar (Lark or GBNF)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    # vLLM's extras
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's beam-search extras: best_of beams (default n), the n best returned
    use_beam_search: bool = False
    best_of: int | None = Field(default=None, ge=1)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # Token controls and structured outputs (OpenAI's logit_bias and response_format,
    # vLLM's allowed_token_ids, bad_words and structured_outputs)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: logprobs of the prompt's tokens, with this many alternatives each
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint of response_format or structured_outputs (not both)."""
        fmt, so = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and so is not None:
            raise ValueError("response_format and structured_outputs both constrain the output; "
                             "send one")
        if so is not None:
            return StructuredOutputsParams(json=so.json_, json_object=so.json_object,
                                           regex=so.regex, choice=so.choice, grammar=so.grammar)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ValueError("response_format json_schema needs json_schema.schema")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)

    def _controls(self) -> dict[str, Any]:
        return {"logit_bias": self.logit_bias, "allowed_token_ids": self.allowed_token_ids,
                "bad_words": self.bad_words, "structured_outputs": self.constraint(),
                "prompt_logprobs": self.prompt_logprobs_wanted()}

    def prompt_logprobs_wanted(self) -> int | None:
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams of this request; raises ValueError naming a bad field.

        With beam search its n is the beam width (best_of, default n); the server returns
        the n best hypotheses.
        """
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        if self.use_beam_search:
            return SamplingParams(
                n=self.best_of or self.n,
                temperature=0.0 if self.temperature is None else self.temperature,
                seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos, stop=self.stop, stop_token_ids=self.stop_token_ids,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                skip_special_tokens=self.skip_special_tokens, logprobs=logprobs,
                use_beam_search=True, length_penalty=self.length_penalty,
                early_stopping=self.early_stopping, **self._controls())
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of ({self.best_of}) > n ({self.n}) needs use_beam_search: "
                             f"sampled completions are not ranked")
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, **self._controls())


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)   # 0 only with echo: the prompt alone
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    def prompt_logprobs_wanted(self) -> int | None:
        """echo with logprobs returns the prompt's logprobs too (as lm-eval-harness reads)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str   # JSON text, as OpenAI sends it


class ToolCallParam(_Strict):
    """A call the assistant made, sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    # what our own responses carry, accepted back (not rendered: templates drop it)
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(_Strict):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if self.input and all(isinstance(t, int) for t in self.input):
            return [self.input]  # type: ignore[list-item]
        return list(self.input)  # type: ignore[arg-type]


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None   # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class GenerateRequest(_Strict):
    """The job API of seed 004 (vllmini): POST /generate returns an id at once."""

    prompt: str | list[int]
    max_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=self.stop)
