"""`refusion serve`: one or more decoders, each on its checkpoint, behind an OpenAI-compatible HTTP API.

A thin wrapper over :mod:`refusion_cli.serve`: reads ``--decoder``, ``--model`` and ``--set`` as eval, bench and
chat do (``--model CHECKPOINT`` for every decoder, ``DECODER=CHECKPOINT`` for one, else each decoder's embedded
model), resolves each checkpoint once and checks that every decoder fits its own (from its config, before any
weights load), loads each checkpoint once (a scheduler of its own), then runs uvicorn until
SIGTERM or Ctrl-C. SIGTERM takes no new request, lets the running ones finish within
``--shutdown-timeout`` (what is left then ends with an error) and exits 0. A scheduler that dies ends the
server too: every open request gets an error and the process exits 1, so that its supervisor restarts it.
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from refusion_cli.cli.libraries import libraries_imported
from refusion_cli.cli.options import (CausalFirstOpt, CausalFixOpt, DecodersOpt, DeviceOpt, DtypeOpt, ModelsOpt,
                                      MultiValues, PresetOpt, RecheckOpt, SeedOpt, SetOpt, TrustRemoteCodeOpt,
                                      panel_option, option_values, route_stray_values, split_commas)
from refusion_cli.cli.output import err_console, quiet_library_output
from refusion_cli.decoding.memory import ModelSize, parse_memory
from refusion_cli.decoding.registry import decoder_spec
from refusion_cli.decoding.spec import (PRESET_DECODER, DecoderChoice, one_model_each, parse_decoder_options,
                                        require_refusion)
from refusion_cli.decoding.variants import PAPER, Variant, first_option
from refusion_cli.errors import UserError
from refusion_cli.models.chat import require_chat_template
from refusion_cli.models.checkpoint import resolve_checkpoint
from refusion_cli.models.loading import LoadedModel, check_model_fits, load_model
from refusion_cli.serve.protocol import ServedModel, served_id

MODEL = "Model"
DECODING = "Decoding"
SERVER = "Server"


def serve(
    model: Annotated[list[str] | None, panel_option(ModelsOpt, MODEL)] = None,
    decoder: Annotated[list[str] | None, panel_option(DecodersOpt, DECODING, help="decoders to serve, each a model id of its own")] = [PRESET_DECODER],  # noqa: B006
    set_options: Annotated[list[str] | None, panel_option(SetOpt, DECODING)] = None,
    preset: Annotated[str | None, panel_option(PresetOpt, DECODING)] = None,
    causal_fix: Annotated[bool, panel_option(CausalFixOpt, DECODING, help="serve ReFusion with causal_fix=True (this toolkit's "
                         "variant; its model id says so)")] = False,
    causal_first: Annotated[bool, panel_option(CausalFirstOpt, DECODING, help="serve ReFusion with causal_first=True")] = False,
    recheck: Annotated[bool, panel_option(RecheckOpt, DECODING, help="serve ReFusion with recheck=True")] = False,
    seed: Annotated[int, panel_option(SeedOpt, DECODING, help="generator seed of a request that sends none")] = 0,
    host: Annotated[str, typer.Option("--host", help="address to listen on", rich_help_panel=SERVER)] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="port (0: any free one, printed)",
                                      rich_help_panel=SERVER)] = 8000,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="REFUSION_API_KEY", help="require "
                                                "'Authorization: Bearer KEY' on /v1 (or REFUSION_API_KEY)",
                                                rich_help_panel=SERVER)] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, help="rows decoded together at most",
                                           rich_help_panel=SERVER)] = 16,
    max_queue: Annotated[int, typer.Option("--max-queue", min=0, help="requests waiting at most; more get 429",
                                           rich_help_panel=SERVER)] = 256,
    max_memory: Annotated[str | None, typer.Option("--max-memory", metavar="SIZE", help="admit rows while the "
                                                   "memory model's bytes fit SIZE (e.g. 20GiB; default: rows are "
                                                   "bounded by --max-batch only)", rich_help_panel=SERVER)] = None,
    shutdown_timeout: Annotated[float, typer.Option("--shutdown-timeout", min=0, help="seconds running requests "
                                                    "get to finish after SIGTERM", rich_help_panel=SERVER)] = 30.0,
    device: Annotated[str | None, panel_option(DeviceOpt, MODEL)] = None,
    dtype: Annotated[str | None, panel_option(DtypeOpt, MODEL)] = None,
    trust_remote_code: Annotated[bool, panel_option(TrustRemoteCodeOpt, MODEL)] = False,
    stray: Annotated[list[str] | None, typer.Argument(hidden=True, show_default=False, metavar="VALUES",
                                                      help="more values of --decoder, --model or --set")] = None,
) -> None:
    """Serve decoders over an OpenAI-compatible API (/v1/chat/completions, /v1/completions), with a live web view at /."""
    with libraries_imported():
        from refusion_cli.serve.app import ServerState
        from refusion_cli.serve.engine import Scheduler
        from refusion_cli.serve.metrics import ServeMetrics
        from refusion_cli.serve.process import EXIT_SCHEDULER_DIED, Lifeline, check_address, run_server

    if api_key is not None and not api_key.strip():
        raise UserError("--api-key is empty", hint="leave it out to serve without a key")
    memory = None if max_memory is None else parse_memory_option(max_memory)
    values = route_stray_values(list(stray or []), MultiValues(option_values(decoder, "--decoder"), list(model or []),
                                                               split_commas(set_options)), "refusion serve")
    choices = parse_decoder_options(values.decoders, values.models, values.overrides, preset)
    one_model_each(choices, "refusion serve")
    variant = (causal_fix, causal_first, recheck)
    if (option := first_option(*variant)) is not None:
        require_refusion(option, [choice.decoder for choice in choices])
    served = served_models(choices, variant)
    # each checkpoint resolved once; the fit checks (before any weights load) and the loader read its record
    records = {name: resolve_checkpoint(name, trust_remote_code) for name in dict.fromkeys(c.checkpoint for c in choices)}
    for choice in choices:
        check_model_fits(choice.decoder, records[choice.checkpoint])
    check_address(host, port)  # before the models load
    quiet_library_output()
    models: dict[str, LoadedModel] = {}
    for name, record in records.items():
        needs_mask = any(decoder_spec(c.decoder).needs_mask for c in choices if c.checkpoint == name)
        models[name] = load_model(record, device, dtype, require_mask=needs_mask)
        require_chat_template(models[name].tokenizer, f"'{name}'", use="/v1/chat/completions renders chat turns")
    metrics = ServeMetrics()
    lifeline = Lifeline()
    shares = memory_shares(models, memory)
    schedulers = {name: Scheduler(loaded, name, max_batch=max_batch, max_queue=max_queue, max_memory=shares[name],
                                  stats=metrics, on_death=lifeline.die) for name, loaded in models.items()}
    state = ServerState(served, schedulers, metrics, api_key=api_key, seed=seed, shutdown_timeout=shutdown_timeout)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    budgets = ", ".join(f"{name} rows within {s.engine.budget / 2**20:,.0f} MiB {s.engine.source}"
                        for name, s in schedulers.items())
    err_console.print(f"serving {', '.join(f'{e.id} on {e.checkpoint}' for e in served.values())} (max batch "
                      f"{max_batch}, max queue {max_queue}" + (f"; {budgets}" if memory is not None else "") + ")")
    started = run_server(state, host, port, lifeline)
    if lifeline.reason is not None:
        err_console.print(f"error: {lifeline.reason}; the server stopped")
        raise typer.Exit(EXIT_SCHEDULER_DIED)
    if not started:
        raise UserError(f"the server could not start on {host}:{port} (see the log above)",
                        hint="is the port in use? pick another with --port")


def parse_memory_option(text: str) -> int:
    """``--max-memory``: a size such as 20GiB (a bad one is the usual one-line error, exit 2)."""
    try:
        return parse_memory(text)
    except UserError as exc:
        raise UserError(f"--max-memory: {exc}") from None


def memory_shares(models: dict[str, LoadedModel], max_memory: int | None) -> dict[str, int | None]:
    """Each checkpoint's part of ``--max-memory``: its weights and an even share of what the weights leave."""
    if max_memory is None or len(models) == 1:
        return dict.fromkeys(models, max_memory)
    weights = {name: ModelSize.of(loaded.model).weights for name, loaded in models.items()}
    spare = (max_memory - sum(weights.values())) // len(models)
    if spare <= 0:
        raise UserError(f"--max-memory {max_memory / 2**20:,.0f} MiB does not hold the weights of "
                        f"{', '.join(models)} ({sum(weights.values()) / 2**20:,.0f} MiB)")
    return {name: weights[name] + spare for name in models}


def served_models(choices: list[DecoderChoice], variant: Variant) -> dict[str, ServedModel]:
    """One model id per decoder (ReFusion's carries the variant)."""
    served = {}
    for choice in choices:
        flags = variant if choice.decoder == PRESET_DECODER else PAPER
        choice.config()  # refuse bad --set values before loading anything
        entry = ServedModel(served_id(choice.decoder, flags), choice, flags)
        served[entry.id] = entry
    return served
