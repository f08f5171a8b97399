"""Protocol models of structured output and tool calling (OpenAI's ``response_format``, ``tools``,
``tool_choice``, ``tool_calls``; vLLM's ``structured_outputs``), and of retention hints (``retention_directives``),
used by ``protocol.py``'s request and response models."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer


# ---- requests -------------------------------------------------------------------------------------
class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of a JSON schema, any JSON object, a regular expression,
    a list of choices or an EBNF grammar (xgrammar's dialect), and vLLM's ``disable_any_whitespace``."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # JSON (``json``, ``json_object``) in one fixed layout (true) or with any whitespace between its tokens
    # (false); unset: the server's ``disable_any_whitespace``
    disable_any_whitespace: bool | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always follow ``parameters`` when a call is forced


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# ---- responses ------------------------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=new_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class _DropNone(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DropNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    """One piece of a streamed tool call: the first carries its id, type and name, later ones pieces of
    its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class RetentionDirective(BaseModel):
    """A range of the prompt's tokens to keep cached at a priority for a while (vLLM's proposed
    ``retention_directives``; scheduler/kv/retention.py)."""

    model_config = ConfigDict(extra="forbid")

    start: int = Field(0, ge=0)
    end: int | None = Field(None, ge=1)  # one past its last token (None: the prompt's end)
    priority: int = Field(ge=1, le=100)
    duration: float | None = Field(None, gt=0)  # seconds after its last use (None: 300, a prompt cache's usual)
