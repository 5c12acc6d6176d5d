"""Every decoder of the registry as an lm-eval model of its name (``refusion``, ``ar``, ``llada``, ...):
:data:`ADAPTERS` is made from ``decoding.registry.DECODERS``, so a new registry entry is an lm-eval model too.

Importing this module registers them with ``lm_eval.api.registry`` (lm-eval has no plugin
discovery). Contract of every adapter:

- ``model_args`` (``pretrained=refusion-tiny,slot_size=8,token_threshold=0.4``) hold adapter
  options (``model_args.ADAPTER_OPTIONS``: where the model comes from and how it runs) and decoder options
  (the fields of the decoder's config dataclass, via ``registry.build_config``, starting from
  ``preset=<paper task>`` for ReFusion); the ReFusion adapter also takes ``causal_fix``, ``causal_first``
  and ``recheck`` (this toolkit's decoding variants, ``decoding.variants``). Any other key is an error,
  never ignored.
- ``generate_until`` decodes its requests through one ``decoding.engine.Engine``, ``batch_size`` rows at
  most (default 1, the paper's setting), a finished request's row going to the next one at once; every
  request gets the answer it gets alone up to float rounding (the decoders batch row for row), and with
  more than one row the wall time is shared out as requests finish (``SampleRecord.wall_share``).
  ``batch_size=auto`` admits rows while ``decoding.memory``'s model fits them in ``max_memory`` (or the
  free memory), at most ``max_batch_size``; a model call that runs out of memory puts its rows back in
  the queue and the engine goes on with fewer (nothing of them was recorded). ``adapter.batch_notes``
  says what bounded the rows and every such event. ``max_gen_toks`` becomes the
  config's ``gen_length``, and the settings that follow the length move with it as ``refusion eval``
  sets them (``registry.length_settings``: LLaDA's and Dream's ``steps``, LLaDA's ``block_length``)
  unless ``model_args`` set them; the response becomes text as ``protocol`` says
  (:mod:`refusion_cli.harness.answers`: ``lm-eval``, the default, ends it at any end id, decodes
  it without special tokens and cuts it at the first ``until`` string; ``paper`` follows the
  script of the decoder's Table 1 row). The decoders decode as their config says (greedy, or ReFusion's planning noise), so a
  request for sampling (``do_sample=True``, or a ``temperature`` above 0 without ``do_sample=False``,
  as lm-eval's HF model reads them) is an error rather than a greedy answer under a sampling task's
  name; greedy settings of those keys and ``top_p`` / ``top_k`` are accepted; any other generation key
  is an error. Each request gets a
  fresh ``torch.Generator`` seeded with ``seed``, so an output never depends on request order.
  Every decoded request appends a :class:`SampleRecord` (tokens, forwards, seconds, TPS) to
  ``adapter.samples``. Unless it is constructed ``warmed_up``, the first request an adapter decodes is decoded
  once more before it, untimed and discarded (warm-up: CUDA context, kernels and allocator are not
  billed to one sample). An optional :class:`GenerationHook` (``hook=``, given at construction) sees every
  request first and may return a stored output instead (the harness uses it to resume and to journal samples).
- ``loglikelihood`` / ``loglikelihood_rolling`` are exact for the causal adapters (``refusion``,
  ``ar``): one causal pass per request, lm-eval's tokenisation rules (``TemplateLM``). The
  masked-diffusion adapters (``llada``, ``dream``) have no exact likelihood and refuse them.
- Chat templates: ``apply_chat_template`` / ``tokenizer_name`` / ``chat_template`` are the
  tokenizer's, so lm-eval's ``--apply_chat_template`` works.
- Data parallel: under ``accelerate launch`` / ``torchrun`` (``WORLD_SIZE`` > 1) the adapter
  takes its rank and world size from Accelerate and implements lm-eval's collectives, so lm-eval
  gives each process its share of the documents and merges the results on rank 0.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, ClassVar

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from refusion_cli.decoding.config import ConfigError
from refusion_cli.decoding.memory import parse_memory
from refusion_cli.decoding.engine import Engine, run_decoder
from refusion_cli.decoding.registry import DECODERS, DecoderSpec, decoder_spec, default_model
from refusion_cli.decoding.spec import PRESET_DECODER
from refusion_cli.decoding.stats import DecodeResult, float_logits
from refusion_cli.decoding.variants import FLAGS, Variant, variant_options
from refusion_cli.errors import UserError
from refusion_cli.harness.answers import answer_rule
from refusion_cli.harness.manifest import EvalProtocol
from refusion_cli.harness.model_args import (AUTO, as_bool, batch_size_value, check_model_args, decoder_choice,
                                             lm_eval_default_device)
from refusion_cli.harness.requests import (SAMPLING_KEYS, GenerationHook, PreparedRequest, SampleRecord,
                                           asks_for_sampling, stop_strings, with_gen_length)
from refusion_cli.models.checkpoint import resolve_checkpoint
from refusion_cli.models.devices import parse_device, parse_dtype
from refusion_cli.models.loading import LoadedModel, check_model_fits, load_model


def distributed_context(device: str | torch.device | None = None) -> tuple[int, int, Any]:
    """(rank, world size, accelerator) of this process; one process without an accelerator. ``device`` is
    one the caller checked (``refusion eval``: at planning; the adapters: ``load_model``).

    Several processes on CPUs (``--device cpu``, or no GPU) join a gloo group: Accelerate only
    does that when asked for the CPU explicitly.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, None
    from accelerate import Accelerator

    on_cpu = (device is not None and torch.device(device).type == "cpu") or not torch.cuda.is_available()
    accelerator = Accelerator(cpu=on_cpu)
    return accelerator.process_index, accelerator.num_processes, accelerator


def same_config(pending: list[tuple[int, PreparedRequest]]) -> list[list[tuple[int, PreparedRequest]]]:
    """The pending requests grouped by config, each group in the requests' order (the first config first)."""
    groups: dict[int, list[tuple[int, PreparedRequest]]] = {}
    configs: list[Any] = []
    for item in pending:
        key = next((number for number, config in enumerate(configs) if config == item[1].config), len(configs))
        if key == len(configs):
            configs.append(item[1].config)
        groups.setdefault(key, []).append(item)
    return list(groups.values())


class DecoderLM(TemplateLM):
    """An lm-eval model that generates with one of the project's decoders (see the module docstring)."""

    decoder: ClassVar[str]  # key in refusion_cli.decoding.registry.DECODERS

    def __init__(
        self,
        pretrained: str | LoadedModel | None = None,
        device: str | None = None,
        dtype: str | None = None,
        trust_remote_code: bool | str = False,
        preset: str | None = None,
        seed: int | str = 0,
        enable_thinking: bool | str | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | str | None = None,
        max_memory: int | str | None = None,
        config: Any | None = None,
        causal_fix: bool | str = False,
        causal_first: bool | str = False,
        recheck: bool | str = False,
        protocol: EvalProtocol | str = EvalProtocol.LM_EVAL,
        hook: GenerationHook | None = None,
        warmed_up: bool = False,
        **decoder_options: Any,
    ) -> None:
        super().__init__()
        try:
            self.answers = answer_rule(self.decoder, EvalProtocol(protocol))
        except ValueError:
            raise ConfigError(f"protocol must be one of {', '.join(p.value for p in EvalProtocol)}, "
                              f"got {protocol!r}") from None
        check_model_args(self.decoder, set(decoder_options))  # unknown keys fail before anything loads
        self.batch_size = batch_size_value(batch_size)  # a number, or AUTO: chosen per generate_until call
        self.max_batch_size = None if max_batch_size is None else batch_size_value(max_batch_size)
        self.max_memory = None if max_memory is None else parse_memory(max_memory)
        if self.batch_size != AUTO and (self.max_memory is not None or self.max_batch_size is not None):
            raise ConfigError("max_memory and max_batch_size bound batch_size=auto; give batch_size=auto with them")
        if self.max_batch_size == AUTO:
            raise ConfigError("max_batch_size must be a whole number of requests")
        self.batch_notes: list[str] = []  # what batch_size=auto chose and every halving, in order
        spec = decoder_spec(self.decoder)
        if config is not None and (decoder_options or preset is not None):
            raise ConfigError("pass either a config object or decoder options / preset, not both")
        if config is not None and not isinstance(config, spec.config_class):
            raise ConfigError(f"the {self.decoder} adapter takes a {spec.config_class.__name__} as config")
        # the model_args options, kept to rebuild the config for each max_gen_toks (None: a config object was given)
        named = None if isinstance(pretrained, LoadedModel) else pretrained or default_model(self.decoder)
        self.choice = None if config is not None else decoder_choice(self.decoder, preset, decoder_options, named)
        self.config: Any = config if self.choice is None else self.choice.config()  # the decoder's config class
        self.seed = int(seed)
        variant: Variant = (as_bool("causal_fix", causal_fix), as_bool("causal_first", causal_first),
                            as_bool("recheck", recheck))
        if any(variant) and self.decoder != PRESET_DECODER:
            given = next(flag for flag, on in zip(FLAGS, variant) if on)
            raise ConfigError(f"{given} applies to the {PRESET_DECODER} adapter only, not {self.decoder}")
        self.flags = variant  # ReFusion's variant (all False: the paper's decoder)
        self.variant = variant_options(variant)  # the same as run_decoder's keyword arguments
        self.chat_template_args: dict[str, Any] = {}
        if enable_thinking is not None:
            self.chat_template_args["enable_thinking"] = as_bool("enable_thinking", enable_thinking)
        self._rank, self._world_size, self.accelerator = distributed_context(device)
        if self.accelerator is not None:
            device = str(self.accelerator.device)
        if isinstance(pretrained, LoadedModel):  # loaded, and fitted to its decoders, by the caller (eval: at planning)
            self.loaded = pretrained
        else:  # the device and dtype checked first, then the checkpoint resolved, its fit checked, and loaded
            checked_device, checked_dtype = parse_device(device), parse_dtype(dtype) if dtype is not None else None
            checkpoint = resolve_checkpoint(pretrained or default_model(self.decoder),
                                            as_bool("trust_remote_code", trust_remote_code))
            check_model_fits(self.decoder, checkpoint)
            self.loaded = load_model(checkpoint, checked_device, checked_dtype, require_mask=spec.needs_mask)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self._device = next(self.model.parameters()).device
        self.hook = hook  # sees every request first (the harness's journal: resume and records)
        self.samples: list[SampleRecord] = []
        self.warmed_up = warmed_up  # False: the first decode is preceded by an untimed one

    # --- lm-eval plumbing -------------------------------------------------------------------

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None):
        """lm-eval's constructor path, with a key set both in ``model_args`` and by a command-line option
        (``--device``, ``--batch_size``) allowed once: equal values merge, different ones are a ConfigError
        (lm-eval's own merge raised a TypeError). lm-eval's default device (``cuda:0`` when ``--device`` is
        absent) counts as not given: ``device=`` in ``model_args``, else the adapter's default, applies."""
        merged = dict(arg_dict)
        for key, value in (additional_config or {}).items():
            if value is None or (key == "device" and value == lm_eval_default_device()):
                continue  # not given (lm-eval passes its own default device when --device is absent)
            if key in merged and str(merged[key]) != str(value):
                raise ConfigError(f"{key} is given twice: {merged[key]!r} in model_args and {value!r} "
                                  f"from the command line (--{key}); give it once")
            merged[key] = value
        return cls(**merged)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None):
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def end_ids(self) -> tuple[int, ...]:
        """The ids that end a response under this adapter's answer handling."""
        return self.answers.end_ids(self.loaded)

    @property
    def eot_token_id(self) -> int:
        return self.loaded.eos_token_id

    @property
    def max_length(self) -> int:
        """Longest input the model takes (its position table)."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return list(self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"])

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    @property
    def tokenizer_name(self) -> str:
        return self.loaded.source.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt, **self.chat_template_args,
        )

    def get_model_info(self) -> dict[str, Any]:
        return {"decoder": self.decoder, "model_source": self.loaded.source,
                "decoder_config": dataclasses.asdict(self.config), "seed": self.seed}

    # data parallel (lm-eval calls these when world_size > 1)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size <= 1:
            return tensor
        return self.accelerator.gather(tensor)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size <= 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj=obj, object_gather_list=gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            self.accelerator.wait_for_everyone()

    # --- generation -------------------------------------------------------------------------

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        if self.hook is not None:
            self.hook.start(requests)
        outputs: list[str | None] = [None] * len(requests)
        pending: list[tuple[int, PreparedRequest]] = []
        for index, request in enumerate(requests):
            stored = self.hook.lookup(request) if self.hook is not None else None
            if stored is not None:
                outputs[index] = stored
                continue
            pending.append((index, self.prepare(*request.args)))
        if pending and not self.warmed_up:
            self.decode(pending[0][1])
            self.warmed_up = True
        if pending:
            self.decode_all(requests, pending, outputs)
        return [text for text in outputs if text is not None]

    def engine(self) -> Engine:
        """The engine of one ``generate_until`` call: ``batch_size`` rows at most, or with ``batch_size=auto``
        as many as the memory model fits (``max_memory``, else the free memory), at most ``max_batch_size``."""
        if self.batch_size == AUTO:
            return Engine(self.model, max_rows=self.max_batch_size, max_memory=self.max_memory,  # type: ignore[arg-type]
                          budget_memory=True)
        return Engine(self.model, max_rows=int(self.batch_size))

    def decode_all(self, requests: list[Instance], pending: list[tuple[int, PreparedRequest]],
                   outputs: list[str | None]) -> None:
        """Decode the pending requests through one engine (continuous batching; requests of one config at a time),
        each recorded as it finishes, so an interrupted run keeps every finished sample. With more than one row, a
        sample's ``wall_share`` is the wall time since the previous one finished: the shares sum to the run's."""
        engine = self.engine()
        if self.batch_size == AUTO:  # what the memory model admits of the longest prompt
            longest = max((prepared for _, prepared in pending), key=lambda prepared: len(prepared.prompt_ids))
            choice = engine.rows_that_fit(self.decoder, longest.config, len(longest.prompt_ids), len(pending))
            self.batch_notes.append(choice.describe() if choice else "")
        last = [time.perf_counter()]
        for group in same_config(pending):
            recorded: set[int] = set()

            def finish(position: int, result: DecodeResult, group: list[tuple[int, PreparedRequest]] = group,
                       recorded: set[int] = recorded) -> None:
                index, prepared = group[position]
                now, rows = time.perf_counter(), max(engine.counts.peak_rows, 1)
                self.record(requests[index], self.sample(prepared, result, rows, now - last[0] if rows > 1 else None))
                outputs[index] = self.samples[-1].text
                recorded.add(position)
                last[0] = now

            generators = [torch.Generator(device=self._device).manual_seed(self.seed) for _ in group]
            results = run_decoder(self.decoder, self.model, [prepared.prompt_ids for _, prepared in group],
                                  group[0][1].config, mask_token_id=self.loaded.mask_token_id,
                                  eos_token_id=self.end_ids, generator=generators, engine=engine, on_result=finish,
                                  **self.variant)
            for position, result in enumerate(results):  # a run_decoder that did not report them as they finished
                if position not in recorded:
                    finish(position, result)
        self.batch_notes.extend(engine.counts.notes)

    def record(self, request: Instance, sample: SampleRecord) -> None:
        """Keep a decoded request's sample: here, in the hook's journal, in lm-eval's cache."""
        self.samples.append(sample)
        if self.hook is not None:
            self.hook.record(request, sample)
        self.cache_hook.add_partial("generate_until", request.args, sample.text)

    def generate(self, context: str, gen_kwargs: dict[str, Any] | None = None) -> SampleRecord:
        """Decode one prompt string (already chat-templated if wanted) under lm-eval's generation keys."""
        return self.decode(self.prepare(context, gen_kwargs))

    def prepare(self, context: str, gen_kwargs: dict[str, Any] | None = None) -> PreparedRequest:
        """A request's prompt ids and config under lm-eval's generation keys (checked here)."""
        gen_kwargs = dict(gen_kwargs or {})
        until = stop_strings(gen_kwargs)
        max_gen_toks = gen_kwargs.pop("max_gen_toks", None)
        unknown = sorted(set(gen_kwargs) - {"until"} - SAMPLING_KEYS)
        if unknown:
            raise UserError(f"the {self.decoder} adapter does not take the generation key(s) {', '.join(unknown)}",
                            hint="set decoder options through model_args instead")
        if asks_for_sampling(gen_kwargs):
            asked = ", ".join(f"{key}={gen_kwargs[key]}" for key in ("do_sample", "temperature") if key in gen_kwargs)
            raise UserError(f"the task asks for sampling ({asked}), but the {self.decoder} adapter decodes as its "
                            "config says and would answer greedily under a sampling task's name",
                            hint="run a greedy task (do_sample=false, temperature=0); decoder options such as "
                                 "ReFusion's planning noise go in model_args")
        config = self.config if max_gen_toks is None else with_gen_length(self.config, int(max_gen_toks), self.choice)
        prompt_ids = self.tok_encode(context)
        response = getattr(config, "padded_length", config.gen_length)  # ReFusion rounds up to whole slots
        room = self.max_length - response
        if room < 1:
            raise UserError(f"a {response}-token response leaves no room for a prompt in the model's "
                            f"{self.max_length} positions")
        cut = max(0, len(prompt_ids) - room)
        return PreparedRequest(prompt_ids[cut:], config, until, cut)  # keeps an over-long prompt's end, as lm-eval's HF

    def decode(self, prepared: PreparedRequest) -> SampleRecord:
        """Decode one request alone, with a generator seeded with ``seed``."""
        (result,) = run_decoder(self.decoder, self.model, [prepared.prompt_ids], prepared.config,
                                mask_token_id=self.loaded.mask_token_id, eos_token_id=self.end_ids,
                                generator=[torch.Generator(device=self._device).manual_seed(self.seed)],
                                **self.variant)  # a list of one, as every decode of this adapter
        return self.sample(prepared, result)

    def sample(self, prepared: PreparedRequest, result: DecodeResult, rows: int = 1,
               wall_share: float | None = None) -> SampleRecord:
        """What a decoded request gives back: its text by the answer rule, and its counts."""
        return SampleRecord(text=self.answers.text(self.tokenizer, result.tokens, prepared.until),
                            prompt_tokens=len(prepared.prompt_ids), stats=result.stats, prompt_cut=prepared.cut,
                            batch_rows=rows, wall_share=wall_share)

    # --- likelihoods ------------------------------------------------------------------------

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        raise self._no_likelihood()

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              **kwargs: Any) -> list[tuple[float, bool]]:
        raise self._no_likelihood()

    def _no_likelihood(self) -> UserError:
        return UserError(
            f"the {self.decoder} adapter cannot score log-likelihoods: a masked-diffusion model has no exact "
            "likelihood (only a Monte-Carlo bound)",
            hint="use a generate_until task, or the refusion / ar adapters for loglikelihood tasks",
        )


class CausalDecoderLM(DecoderLM):
    """A decoder over a causal model: log-likelihoods are exact, one causal pass per request."""

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              **kwargs: Any) -> list[tuple[float, bool]]:
        answers = []
        for text_pair, context_ids, continuation_ids in requests:
            answer = self.score_continuation(context_ids, continuation_ids)
            if text_pair is not None:
                self.cache_hook.add_partial("loglikelihood", text_pair, answer)
            answers.append(answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        totals = []
        for request in requests:
            (text,) = request.args
            windows = get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            total = sum(self.score_continuation(*make_disjoint_window(window))[0] for window in windows)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            totals.append(total)
        return totals

    @torch.inference_mode()
    def score_continuation(self, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
        """(sum of log p(continuation | context), whether greedy decoding would produce it)."""
        ids = (list(context_ids) + list(continuation_ids))[-(self.max_length + 1):]
        inputs = torch.tensor([ids[:-1]], device=self._device)  # [1, T-1]
        logits = self.model(input_ids=inputs).logits[0, -len(continuation_ids):]  # [C, V]
        logprobs = torch.log_softmax(float_logits(logits), dim=-1)
        targets = torch.tensor(continuation_ids, device=self._device)  # [C]
        score = logprobs.gather(-1, targets[:, None]).sum()
        greedy = bool((logprobs.argmax(-1) == targets).all())
        return float(score), greedy


def adapter_class(spec: DecoderSpec) -> type[DecoderLM]:
    """The lm-eval model of a registry entry, registered under the decoder's name: exact likelihoods on a
    causal model (:class:`CausalDecoderLM`), none for a masked-diffusion one."""
    base = DecoderLM if spec.bidirectional else CausalDecoderLM
    name = "".join(part.capitalize() for part in spec.name.split("-")) + "LM"  # llada-fast-dllm -> LladaFastDllmLM
    cls = type(name, (base,), {"decoder": spec.name, "__doc__": spec.summary, "__module__": __name__})
    return register_model(spec.name)(cls)


ADAPTERS: dict[str, type[DecoderLM]] = {name: adapter_class(spec) for name, spec in DECODERS.items()}
