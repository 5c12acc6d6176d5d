"""`refusion chat`: a terminal chat with a ReFusion (or baseline) model.

A thin wrapper over :mod:`refusion_cli.chat`: checks the options, resolves the checkpoint and checks that the
decoder fits it (from its config, before any weights load), loads the model, then runs one of three modes:

- ``--prompt "..."``: answer that one question (a leading ``/`` is part of it) and exit (errors
  exit non-zero);
- stdin is a terminal: the interactive chat (live view when stdout is a terminal too);
- stdin is a pipe or a file: answer each line in turn (one conversation, or each question on its
  own with ``--no-history``; slash commands work) and exit at the end of the input, with exit
  status 2 when a line failed (a refused or unknown command, a question that could not be
  answered; each is reported where it happens and the run goes on).

``--system`` / ``--system-file`` give the system message every conversation starts with; a chat
template that cannot render one is an error before the first question. ``--save PATH`` writes the
conversation as JSON (what ``/save`` writes) when the run ends, never over an existing file; an
existing file, or a folder where no file can be created (read-only), is refused before the model loads.

Bytes of stdin that are not valid in its encoding are read as U+FFFD, not refused.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Sequence

import typer
from rich.text import Text

from refusion_cli.chat import ChatApp, ChatSession
from refusion_cli.chat.session import chat_config
from refusion_cli.chat.transcript import FileExists, check_target, check_writable, save_transcript
from refusion_cli.cli.options import (PATH_OPTION, VARIANT_WHAT, CausalFirstOpt, CausalFixOpt, DecoderOpt, DeviceOpt,
                                      DtypeOpt, ModelOpt, MultiValues, PresetOpt, RecheckOpt, SeedOpt, SetOpt,
                                      TrustRemoteCodeOpt, panel_option, route_stray_values, split_commas, text_value)
from refusion_cli.cli.output import console, err_console, quiet_library_output
from refusion_cli.decoding.registry import decoder_spec
from refusion_cli.decoding.spec import PRESET_DECODER, DecoderChoice, one_model_each, parse_decoder_options, require_refusion
from refusion_cli.decoding.variants import first_option
from refusion_cli.errors import UserError
from refusion_cli.models.chat import require_chat_template
from refusion_cli.models.checkpoint import resolve_checkpoint
from refusion_cli.models.loading import check_model_fits, load_model

MODEL = "Model"
DECODING = "Decoding"
CONVERSATION = "Conversation"
SAVE_HINT = "--save never replaces a file: remove it or choose another path"
# --causal-fix, --causal-first, --recheck: a chat runs one decoder, so a variant changes it rather than adding rows
DECODES_WITH = {name: f"ReFusion decodes with {name}=True: {what} (this toolkit's variant)"
                for name, what in VARIANT_WHAT.items()}


def chat(
    model: Annotated[str | None, panel_option(ModelOpt, MODEL)] = None,
    decoder: Annotated[str, panel_option(DecoderOpt, DECODING)] = PRESET_DECODER,
    set_options: Annotated[list[str] | None, panel_option(
        SetOpt, DECODING, help="decoder setting KEY=VALUE or DECODER.KEY=VALUE, e.g. slot_threshold=0.8 "
        "(repeatable; /set in the chat)")] = None,
    preset: Annotated[str | None, panel_option(PresetOpt, DECODING)] = None,
    causal_fix: Annotated[bool, panel_option(CausalFixOpt, DECODING, help=DECODES_WITH["causal_fix"])] = False,
    causal_first: Annotated[bool, panel_option(CausalFirstOpt, DECODING, help=DECODES_WITH["causal_first"])] = False,
    recheck: Annotated[bool, panel_option(RecheckOpt, DECODING, help=DECODES_WITH["recheck"])] = False,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="answer this one question and exit",
                                               rich_help_panel=DECODING)] = None,
    history: Annotated[bool, typer.Option("--history/--no-history", help="keep the conversation (default), or "
                                          "answer every question on its own, e.g. a file of independent "
                                          "questions on stdin", rich_help_panel=CONVERSATION)] = True,
    system: Annotated[str | None, typer.Option("--system", parser=text_value, help="system message every "
                                               "conversation starts with (/system in the chat)",
                                               rich_help_panel=CONVERSATION)] = None,
    system_file: Annotated[Path | None, typer.Option("--system-file", help="read the system message from "
                                                     "this UTF-8 text file", rich_help_panel=CONVERSATION,
                                                     **PATH_OPTION)] = None,
    save: Annotated[Path | None, typer.Option("--save", help="write the conversation as JSON to this new file "
                                              "when the run ends (/save in the chat)",
                                              rich_help_panel=CONVERSATION, **PATH_OPTION)] = None,
    seed: Annotated[int, panel_option(SeedOpt, DECODING, help="seed of the sampling noise (temperature > 0)")] = 0,
    device: Annotated[str | None, panel_option(DeviceOpt, MODEL)] = None,
    dtype: Annotated[str | None, panel_option(DtypeOpt, MODEL)] = None,
    trust_remote_code: Annotated[bool, panel_option(TrustRemoteCodeOpt, MODEL)] = False,
    stray: Annotated[list[str] | None, typer.Argument(hidden=True, show_default=False, metavar="VALUES",
                                                      help="more values of --set")] = None,
) -> None:
    """Chat with a model; answers fill in slot by slot as the decoder commits them.

    In the chat: /set NAME VALUE, /system [TEXT|off], /save PATH, /save! PATH, /stats, /reset, /help, /quit.
    Ctrl-C stops an answer, Ctrl-D leaves.
    """
    choice = chat_choice(decoder, model, set_options, preset, stray or [])
    variant = (causal_fix, causal_first, recheck)
    if (option := first_option(*variant)) is not None:
        require_refusion(option, [choice.decoder])
    spec = decoder_spec(choice.decoder)
    overrides = dict(choice.overrides)
    chat_config(decoder, overrides, preset, choice.checkpoint)  # refuse bad settings before loading anything
    if prompt is not None and not prompt.strip():
        raise UserError("--prompt is empty")
    if system_file is not None:
        if system is not None:
            raise UserError("--system and --system-file both give the system message; pick one")
        system = read_system_file(system_file)
    if save is not None:
        save = save.expanduser()
        save_conversation(save)  # an existing file is refused before the model loads
    name = choice.checkpoint
    if prompt is None and sys.stdin is None:
        raise UserError("stdin is closed: there is nothing to read questions from",
                        hint="pass a question with --prompt, or give the chat a terminal or a file")
    quiet_library_output()
    checkpoint = resolve_checkpoint(name, trust_remote_code)
    check_model_fits(choice.decoder, checkpoint)  # before any weights load, as eval and bench check
    interactive = prompt is None and sys.stdin.isatty()
    with console.status(f"loading {name} …") if interactive and console.is_terminal else nullcontext():
        loaded = load_model(checkpoint, device, dtype, require_mask=spec.needs_mask)
    require_chat_template(loaded.tokenizer, f"'{name}'")
    session = ChatSession(loaded, decoder, overrides, model_name=name, seed=seed, keep_history=history,
                          system=system, preset=preset, variant=variant)
    app = ChatApp(session, console, err_console, strict=prompt is not None)
    try:
        failed = run_mode(app, prompt, interactive)
    except KeyboardInterrupt:  # Ctrl-C stops --prompt and piped runs: the answers so far are still saved
        if save is not None and session.exchanges:
            save_answers(app, save, session)
        raise
    if save is not None:
        save_answers(app, save, session)
    if failed:
        lines = ", ".join(str(number) for number in failed)
        raise UserError(f"input line{'s' if len(failed) > 1 else ''} {lines} failed (reported above)")


def run_mode(app: ChatApp, prompt: str | None, interactive: bool) -> list[int]:
    """Answer ``--prompt``, or chat at the terminal, or answer stdin's lines; the numbers of the lines that failed."""
    if prompt is not None:
        app.answer(prompt.strip())  # a question, even one that starts with "/"
        return []
    _lenient_stdin()
    if interactive:
        _line_editing()
        app.run_interactive()
        return []
    return app.run_lines(sys.stdin)


def save_answers(app: ChatApp, path: Path, session: ChatSession) -> None:
    save_conversation(path, session)
    app.notice(Text(f"saved {len(session.exchanges)} answer(s) to {path}"))


def read_system_file(path: Path) -> str:
    """``--system-file``: the file's text, surrounding blank space dropped; unreadable or empty is an error."""
    try:
        text = path.expanduser().read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise UserError(f"cannot read --system-file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise UserError(f"--system-file {path} is not UTF-8 text") from exc
    if not text:
        raise UserError(f"--system-file {path} is empty")
    return text


def save_conversation(path: Path, session: ChatSession | None = None) -> None:
    """``--save``: check the target (before the model loads: no ``session`` yet), or write the session's transcript."""
    try:
        if session is None:
            check_target(path)
            check_writable(path)  # a read-only folder is found now, not after the whole conversation
        else:
            save_transcript(path, session.transcript())
    except FileExists as exc:
        raise UserError(f"--save: {exc}", hint=SAVE_HINT) from exc
    except UserError as exc:
        raise UserError(f"--save: {exc}") from exc


def chat_choice(decoder: str, model: str | None, set_options: list[str] | None, preset: str | None,
                stray: Sequence[str] = ()) -> DecoderChoice:
    """The chat's decoder, checkpoint, --set values (``--set a=1 b=2``: the values after the first arrive as
    ``stray``) and preset, in the grammar eval and bench share."""
    values = route_stray_values(list(stray), MultiValues([], [model] if model is not None else [],
                                                         split_commas(set_options)), "refusion chat")
    choices = parse_decoder_options([decoder], values.models, values.overrides, preset)
    one_model_each(choices, "refusion chat")
    if len(choices) > 1:
        raise UserError(f"--decoder {decoder}: a chat runs one decoder", hint="pick one of them")
    return choices[0]


def _lenient_stdin() -> None:
    """Read bytes that are not valid in stdin's encoding as U+FFFD (a stray Latin-1 byte in a file of
    questions, or typed at a terminal set to another encoding), not as an error or a lone surrogate."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="replace")


def _line_editing() -> None:
    """Arrow keys and history at the prompt, where the platform has readline."""
    try:
        import readline  # noqa: F401  (importing it is what enables it for input())
    except ImportError:
        pass
