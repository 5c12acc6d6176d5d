"""The OpenAI request bodies the server takes, parsed and validated into a :class:`Generation`, and the
error object every refusal becomes.

Validation happens here, once: a field of the wrong type, a value out of range, an unknown model
(404), a prompt plus ``max_tokens`` past the model's context, a decoder setting its config class
refuses: each is an :class:`ApiError` naming the field (``param``). Decoder settings travel in one
extension object, ``decoder_options`` (the names and values of ``--set``), checked by the same config
classes; ``max_tokens`` becomes the config's ``gen_length`` (the settings that follow it move with it,
as in ``refusion eval``), and a response never holds more than ``max_tokens`` tokens (ReFusion's budget,
rounded up to whole slots, is cut there); ``temperature`` / ``top_p`` set the decoder's fields of those names
where its config has them (a decoder without the field takes only its neutral value); ``seed`` seeds the
row's generator (default: the server's ``--seed``).

vLLM's extension fields, as its OpenAI server reads them: ``ignore_eos``, ``min_tokens``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``n`` (rows of their own, seeds ``seed + i``),
``stream_options.continuous_usage_stats``; ``top_k`` and ``repetition_penalty`` at their neutral values only.
On ``/v1/completions`` ``prompt`` is a string, a list of strings, a list of token ids or a list of such lists
(one choice per prompt, ``n`` per prompt, in order).
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
from refusion_cli.serve.text import TextRules

SEED_LIMIT = 2**63
MAX_STOPS = 4  # as the OpenAI API
MAX_CHOICES = 128  # prompts times n in one request
IGNORED = {"user", "metadata", "store", "service_tier"}  # accepted and ignored: they change nothing in an answer
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "echo": False, "best_of": 1, "logit_bias": None,
           "parallel_tool_calls": None}  # only this value is taken
NO_LOGPROBS = ("these decoders give no log-probabilities (a masked-diffusion step or a ReFusion slot commits "
               "tokens without a per-token distribution to report)")
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
          "decoder_options", "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens",
          "include_stop_str_in_output", "n", "top_k", "repetition_penalty", "logprobs", "top_logprobs"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = COMMON | {"prompt"}


class ApiError(Exception):
    """A refused request: the HTTP status and the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id  # the id the log holds this request's cause under (a 5xx)
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
    """One model id the server answers for: a decoder (and ReFusion variant) on its checkpoint, with its starting
    settings."""

    id: str
    choice: DecoderChoice  # the decoder, --preset and --set values it was served with
    variant: Variant = PAPER

    @property
    def decoder(self) -> str:
        return self.choice.decoder

    @property
    def checkpoint(self) -> str:
        return self.choice.checkpoint

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
    """A parsed, validated request: one choice per prompt and ``n``."""

    served: ServedModel
    prompts: list[list[int]]  # one for chat; completions: one per prompt given
    config: Any
    rules: TextRules
    seed: int
    n: int  # choices per prompt, seeds seed + i
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage on every chunk (stream_options.continuous_usage_stats, with include_usage)
    chat: bool  # /v1/chat/completions (else /v1/completions)

    @property
    def choices(self) -> list[tuple[int, list[int], int]]:
        """(index, prompt ids, seed) of each choice, in order: prompt by prompt, ``n`` each."""
        return [(p * self.n + i, prompt, self.seed + i) for p, prompt in enumerate(self.prompts) for i in range(self.n)]


def parse_generation(body: Any, *, chat: bool, served: dict[str, ServedModel], models: dict[str, Any],
                     default_seed: int) -> Generation:
    """A request body of ``/v1/chat/completions`` (``chat``) or ``/v1/completions``, checked against the served
    model's checkpoint (``models``: the loaded models by checkpoint). Tokenizes and renders the chat template:
    call it off the event loop."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name in NEUTRAL:
            if body[name] not in (NEUTRAL[name], None):
                raise ApiError(400, f"'{name}' is not supported (only {NEUTRAL[name]!r})", param=name)
        elif name not in allowed and name not in IGNORED:
            raise ApiError(400, f"unknown field '{name}'", param=name)
    _check_sampling_extensions(body)
    model = _typed(body, "model", str, required=True)
    if model not in served:
        raise ApiError(404, f"the model '{model}' does not exist; served: {', '.join(served)}", param="model",
                       code="model_not_found")
    entry = served[model]
    loaded = models[entry.checkpoint]
    max_tokens = _max_tokens(body, chat)
    options = _decoder_options(body, entry)
    config = _config(entry, max_tokens, options)
    rules = _text_rules(body, loaded, config, max_tokens)
    n = _typed(body, "n", int)
    n = 1 if n is None else n
    if n < 1:
        raise ApiError(400, f"'n' must be at least 1, got {n}", param="n")
    seed = _typed(body, "seed", int)
    prompts = [_messages_ids(body, loaded)] if chat else _prompts_ids(body, loaded)
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompt(s) times n={n} is more than {MAX_CHOICES} choices", param="n")
    if seed is not None and not 0 <= seed <= SEED_LIMIT - n:
        raise ApiError(400, f"'seed' must be from 0 to 2**63 - n, got {seed}", param="seed")
    for prompt in prompts:
        _check_context(loaded, prompt, config)
    stream = _typed(body, "stream", bool) or False
    include_usage, continuous = _stream_options(body)
    return Generation(entry, prompts, config, rules, default_seed if seed is None else seed, n, stream,
                      include_usage, include_usage and continuous, chat)


def parse_tokenize(body: Any, *, served: dict[str, ServedModel], models: dict[str, Any]) -> tuple[list[int], Any]:
    """vLLM's ``/tokenize`` body: ``model`` (needed when the served models are on several checkpoints),
    ``prompt`` (a string) or ``messages`` (rendered with the chat template), ``add_special_tokens`` (default:
    true for a prompt, as vLLM); the token ids and the loaded model that read them."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = set(body) - {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"}
    if unknown:
        raise ApiError(400, f"unknown field '{sorted(unknown)[0]}'", param=sorted(unknown)[0])
    model = _typed(body, "model", str)
    if model is not None and model not in served:
        raise ApiError(404, f"the model '{model}' does not exist; served: {', '.join(served)}", param="model",
                       code="model_not_found")
    if model is None and len(models) > 1:
        raise ApiError(400, f"'model' is required: the served models are on {len(models)} checkpoints "
                            f"({', '.join(models)}), each with its tokenizer", param="model")
    loaded = models[served[model].checkpoint] if model is not None else next(iter(models.values()))
    if "messages" in body:
        return _messages_ids(body, loaded), loaded
    prompt = _typed(body, "prompt", str, required=True)
    special = _typed(body, "add_special_tokens", bool)
    ids = loaded.tokenizer(prompt, add_special_tokens=True if special is None else special)["input_ids"]
    return list(ids), loaded


def _check_sampling_extensions(body: dict[str, Any]) -> None:
    """``top_k`` and ``repetition_penalty`` at their neutral values; log-probabilities refused, saying why."""
    top_k = _typed(body, "top_k", int)
    if top_k is not None and top_k not in (-1, 0):
        raise ApiError(400, f"'top_k' is not supported (only -1 or 0, all tokens), got {top_k}: the decoders keep "
                            "a token by its probability against their thresholds, not among the k likeliest",
                       param="top_k")
    penalty = body.get("repetition_penalty")
    if penalty is not None and (isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or penalty != 1):
        raise ApiError(400, f"'repetition_penalty' is not supported (only 1.0), got {penalty!r}: a diffusion step "
                            "commits tokens in parallel, without the left-to-right history a penalty reads",
                       param="repetition_penalty")
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    for name, asked in (("logprobs", not (logprobs is None or logprobs is False)),
                        ("top_logprobs", not (top is None or (top == 0 and not isinstance(top, bool))))):
        if asked:
            raise ApiError(400, f"'{name}' is not supported: {NO_LOGPROBS}", param=name)


def _text_rules(body: dict[str, Any], loaded: Any, config: Any, max_tokens: int | None) -> TextRules:
    ignore_eos = _typed(body, "ignore_eos", bool) or False
    min_tokens = _typed(body, "min_tokens", int) or 0
    budget = response_budget(config)
    if min_tokens < 0:
        raise ApiError(400, f"'min_tokens' must be at least 0, got {min_tokens}", param="min_tokens")
    length = max_tokens if max_tokens is not None else getattr(config, "gen_length", budget)
    if min_tokens > length:
        raise ApiError(400, f"'min_tokens' ({min_tokens}) must be at most max_tokens ({length})", param="min_tokens")
    stop_ids = body.get("stop_token_ids") or []
    vocab = loaded.model.get_input_embeddings().num_embeddings
    if not isinstance(stop_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab
                                                 for i in stop_ids):
        raise ApiError(400, f"'stop_token_ids' must be an array of token ids (0 to {vocab - 1})",
                       param="stop_token_ids")
    skip_special = _typed(body, "skip_special_tokens", bool)
    return TextRules(frozenset(loaded.stop_token_ids), tuple(_stops(body)),
                     include_stop=_typed(body, "include_stop_str_in_output", bool) or False,
                     skip_special_tokens=True if skip_special is None else skip_special,
                     ignore_eos=ignore_eos, min_tokens=min_tokens, stop_token_ids=frozenset(stop_ids),
                     max_tokens=length if budget > length else None)


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    options = _typed(body, "stream_options", dict) or {}
    values = {name: options.get(name, False) for name in ("include_usage", "continuous_usage_stats")}
    if set(options) - set(values) or not all(isinstance(value, bool) for value in values.values()):
        raise ApiError(400, "'stream_options' takes 'include_usage' and 'continuous_usage_stats' (true or false)",
                       param="stream_options")
    return values["include_usage"], values["continuous_usage_stats"]


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
    for name, neutral in (("temperature", 0.0), ("top_p", 1.0)):
        value = _typed(body, name, float)
        if value is None:
            continue
        if name in fields:
            options.setdefault(name, value)
        elif value != neutral:
            why = ("it samples by Gumbel noise at 'temperature', which has no nucleus to cut" if "temperature" in fields
                   else "it decodes greedily")
            raise ApiError(400, f"the {entry.decoder} decoder has no '{name}': {why} (send {name}={neutral:g} or "
                                "leave it out)", param=name)
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


def _prompts_ids(body: dict[str, Any], loaded: Any) -> list[list[int]]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of such lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_ids(prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(item, str) or (isinstance(item, list)
                                                                                        and _is_ids(item))
                                                           for item in prompt):
        raise ApiError(400, "'prompt' must be a string, an array of strings, an array of token ids or an array of "
                            "such arrays (none empty)", param="prompt")
    vocab = loaded.model.get_input_embeddings().num_embeddings
    prompts = []
    for index, item in enumerate(prompt):
        ids = list(loaded.tokenizer(item, add_special_tokens=False)["input_ids"]) if isinstance(item, str) else item
        if not ids:
            raise ApiError(400, "'prompt' is empty" if len(prompt) == 1 else f"prompt {index} is empty",
                           param="prompt")
        if not all(0 <= token < vocab for token in ids):
            raise ApiError(400, f"prompt {index} holds token ids outside the model's vocabulary (size {vocab})",
                           param="prompt")
        prompts.append(ids)
    return prompts


def _is_ids(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(item, int) and not isinstance(item, bool) for item in items)


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


__all__ = ["ApiError", "Generation", "ServedModel", "error_body", "parse_generation", "parse_tokenize",
           "served_id"]
