"""The OpenAI request bodies the server takes, parsed and validated into a :class:`Generation`, and the
error object every refusal becomes.

Validation happens here, once: a field of the wrong type, a value out of range, an unknown model
(404), a prompt plus ``max_tokens`` past the model's context, a decoder setting its config class
refuses: each is an :class:`ApiError` naming the field (``param``). Decoder settings travel in one
extension object, ``decoder_options`` (the names and values of ``--set``), checked by the same config
classes; ``max_tokens`` becomes the config's ``gen_length`` (the settings that follow it move with it,
as in ``refusion eval``); ``temperature`` / ``top_p`` set the decoder's fields of those names where its
config has them (a decoder without sampling takes only their greedy values); ``seed`` seeds the row's
generator (default: the server's ``--seed``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from refusion_cli.decoding.batching import check_ids
from refusion_cli.decoding.config import config_fields
from refusion_cli.decoding.registry import decoder_spec
from refusion_cli.decoding.rows import response_budget
from refusion_cli.decoding.spec import DecoderChoice
from refusion_cli.decoding.variants import PAPER, Variant, variant_options
from refusion_cli.errors import UserError
from refusion_cli.models.chat import chat_prompt_ids

SEED_LIMIT = 2**63
MAX_STOPS = 4  # as the OpenAI API
IGNORED = {"user", "metadata", "store", "service_tier"}  # accepted and ignored: they change nothing in an answer
NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": None, "top_logprobs": None,
           "echo": False, "best_of": 1, "logit_bias": None, "parallel_tool_calls": None}  # only this value is taken
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
          "decoder_options"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = COMMON | {"prompt"}


class ApiError(Exception):
    """A refused request: the HTTP status and the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class ServedModel:
    """One model id the server answers for: a decoder (and ReFusion variant) with its starting settings."""

    id: str
    choice: DecoderChoice  # the decoder, --preset and --set values it was served with
    variant: Variant = PAPER

    @property
    def decoder(self) -> str:
        return self.choice.decoder

    def config(self, max_tokens: int | None, options: dict[str, Any]) -> Any:
        """The validated config of one request: the served settings, then ``options``; ``max_tokens``
        (when given) is the response budget."""
        overrides = {**self.choice.overrides, **options}
        if max_tokens is not None and "gen_length" not in options:
            overrides.pop("gen_length", None)
        return dataclasses.replace(self.choice, overrides=overrides).config(max_tokens)


def served_id(decoder: str, variant: Variant) -> str:
    """The model id of a decoder and its variant: ``refusion``, ``refusion-recheck``, ``llada-fast-dllm``."""
    return "-".join([decoder] + [flag.replace("_", "-") for flag, on in variant_options(variant).items() if on])


@dataclass(frozen=True)
class Generation:
    """A parsed, validated request."""

    served: ServedModel
    prompt_ids: list[int]
    config: Any
    stops: list[str]
    seed: int
    stream: bool
    include_usage: bool
    chat: bool  # /v1/chat/completions (else /v1/completions)


def parse_generation(body: Any, *, chat: bool, served: dict[str, ServedModel], loaded: Any,
                     default_seed: int) -> Generation:
    """A request body of ``/v1/chat/completions`` (``chat``) or ``/v1/completions``, checked."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name in NEUTRAL:
            if body[name] not in (NEUTRAL[name], None):
                raise ApiError(400, f"'{name}' is not supported (only {NEUTRAL[name]!r})", param=name)
        elif name not in allowed and name not in IGNORED:
            raise ApiError(400, f"unknown field '{name}'", param=name)
    model = _typed(body, "model", str, required=True)
    if model not in served:
        raise ApiError(404, f"the model '{model}' does not exist; served: {', '.join(served)}", param="model",
                       code="model_not_found")
    entry = served[model]
    max_tokens = _max_tokens(body, chat)
    options = _decoder_options(body, entry)
    config = _config(entry, max_tokens, options)
    prompt_ids = _messages_ids(body, loaded) if chat else _prompt_ids(body, loaded)
    _check_context(loaded, prompt_ids, config)
    seed = _typed(body, "seed", int)
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise ApiError(400, f"'seed' must be from 0 to 2**63 - 1, got {seed}", param="seed")
    stream = _typed(body, "stream", bool) or False
    stream_options = _typed(body, "stream_options", dict) or {}
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool) or set(stream_options) - {"include_usage"}:
        raise ApiError(400, "'stream_options' takes only 'include_usage' (true or false)", param="stream_options")
    return Generation(entry, prompt_ids, config, _stops(body), default_seed if seed is None else seed, stream,
                      include_usage, chat)


def _typed(body: dict[str, Any], name: str, kind: type, required: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"'{name}' is required", param=name)
        return None
    numeric = kind is float and isinstance(value, int) and not isinstance(value, bool)
    if (kind is int and isinstance(value, bool)) or not (isinstance(value, kind) or numeric):
        names = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object",
                 list: "an array"}
        raise ApiError(400, f"'{name}' must be {names[kind]}, got {value!r}", param=name)
    return float(value) if kind is float else value


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    value = _typed(body, name, int)
    if value is not None and value < 1:
        raise ApiError(400, f"'{name}' must be at least 1, got {value}", param=name)
    return value


def _decoder_options(body: dict[str, Any], entry: ServedModel) -> dict[str, Any]:
    """``decoder_options``, plus ``temperature`` / ``top_p`` where the decoder's config has them."""
    options = dict(_typed(body, "decoder_options", dict) or {})
    fields = config_fields(decoder_spec(entry.decoder).config_class)
    for name, greedy in (("temperature", 0.0), ("top_p", 1.0)):
        value = _typed(body, name, float)
        if value is None:
            continue
        if name in fields:
            options.setdefault(name, value)
        elif value != greedy:
            raise ApiError(400, f"the {entry.decoder} decoder has no '{name}': it decodes greedily "
                                f"(send {name}={greedy:g} or leave it out)", param=name)
    return options


def _config(entry: ServedModel, max_tokens: int | None, options: dict[str, Any]) -> Any:
    try:
        return entry.config(max_tokens, options)
    except (UserError, ValueError) as exc:
        param = "decoder_options" if options else "max_tokens"
        raise ApiError(400, f"decoder settings refused: {exc}", param=param) from exc


def _messages_ids(body: dict[str, Any], loaded: Any) -> list[int]:
    messages = _typed(body, "messages", list, required=True)
    if not messages:
        raise ApiError(400, "'messages' is empty", param="messages")
    rendered = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"{where} must be an object with a 'role'", param=where)
        rendered.append({"role": message["role"], "content": _content(message.get("content"), where)})
    try:
        return chat_prompt_ids(loaded.tokenizer, rendered)
    except UserError as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    except Exception as exc:  # the template refused the conversation (a role it does not take, ...)
        raise ApiError(400, f"the chat template cannot render these messages: {exc}", param="messages") from exc


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def _prompt_ids(body: dict[str, Any], loaded: Any) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string (one prompt per request)", param="prompt")
    if not prompt:
        raise ApiError(400, "'prompt' is empty", param="prompt")
    return list(loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _check_context(loaded: Any, prompt_ids: list[int], config: Any) -> None:
    prompt = torch.tensor(prompt_ids, dtype=torch.long)
    try:
        check_ids(loaded.model, prompt, len(prompt_ids) + response_budget(config))
    except UserError as exc:
        raise ApiError(400, str(exc), param="max_tokens", code="context_length_exceeded") from exc


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(item, str) for item in stops):
        raise ApiError(400, "'stop' must be a string or an array of strings", param="stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    return [item for item in stops if item]


__all__ = ["ApiError", "Generation", "ServedModel", "error_body", "parse_generation", "served_id"]
