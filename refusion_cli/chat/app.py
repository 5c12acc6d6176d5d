"""The chat front end: questions and slash commands in; answers, a live view and stats out.

Contract of :class:`ChatApp`:

- ``handle(line)`` takes one line: a slash command (``/reset``, ``/set NAME VALUE``, ``/system
  [TEXT|off]``, ``/save PATH``, ``/save! PATH``, ``/stats``, ``/help``, ``/quit``) or a question; it
  returns False when the chat should end.
- ``/system TEXT`` sets the system message and starts a new conversation (``off`` removes it);
  ``/system`` alone shows it. ``/save PATH`` writes the conversation as JSON
  (``ChatSession.transcript``) and never replaces a file; ``/save! PATH`` does. A path that cannot
  be written is one line and the chat goes on.
- A question is answered with the live view (when stdout is a terminal), then the answer's text
  and a stats line (tokens, TPS, tokens per forward, forwards, seconds).
- In the interactive chat (``run_interactive()``), Ctrl-C during an answer interrupts it and the
  chat goes on with the conversation unchanged: the first Ctrl-C is honoured at the decoder's next
  step (``on_step`` raises :class:`AnswerInterrupted`), or at once when the decoder has not reported
  a step yet (AR never does); a second one is honoured at once. Elsewhere (``--prompt``, piped
  stdin) Ctrl-C is not caught: it stops the whole run, as in any other command.
- ``run_interactive()`` prompts on a terminal; Ctrl-C at the prompt (or outside an answer) only prints a hint;
  Ctrl-D or ``/quit`` leaves. ``run_lines(lines)`` answers each non-empty line (commands work too)
  and stops at the end of the input: piped stdin. It returns the numbers of the lines that failed
  (a refused or unknown command, a question that could not be answered), so that the caller can
  exit non-zero.
- Off a terminal, consecutive answers are separated by one blank line.
- Where output goes: answers to stdout; everything else (stats, command replies, notices) to
  stdout on a terminal, else to stderr, so ``refusion chat < questions > answers`` leaves only
  answers in the file. A failed answer (e.g. the conversation outgrew the model's context) is
  reported in one line and the chat goes on; with ``strict`` it is raised instead.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.text import Text

from refusion_cli.chat.session import ChatAnswer, ChatSession
from refusion_cli.chat.transcript import FileExists, save_transcript
from refusion_cli.chat.view import LiveAnswer, PieceCache
from refusion_cli.decoding.stats import DecodeStats
from refusion_cli.errors import UserError


@dataclass(frozen=True)
class Command:
    name: str
    usage: str
    summary: str


COMMANDS: dict[str, Command] = {command.name: command for command in (
    Command("/reset", "/reset", "forget the conversation (the system message and the decoder settings stay)"),
    Command("/set", "/set NAME VALUE", "change a decoder setting, e.g. /set slot_threshold 0.8"),
    Command("/system", "/system [TEXT|off]", "show the system message; TEXT sets it, off removes it "
            "(either starts a new conversation)"),
    Command("/save", "/save PATH", "write the conversation so far as JSON (never over an existing file)"),
    Command("/save!", "/save! PATH", "the same, replacing PATH if it exists"),
    Command("/stats", "/stats", "show the decoder, its settings and the last answer's stats"),
    Command("/help", "/help", "list the commands and settings"),
    Command("/quit", "/quit", "leave (Ctrl-D works too)"),
)}
ALIASES = {"/exit": "/quit", "/q": "/quit", "/?": "/help"}


class AnswerInterrupted(Exception):
    """Ctrl-C during an answer."""


class InterruptGuard:
    """While active, Ctrl-C interrupts the answer: at the next decoder step, or at once (see module doc).
    Not ``enabled``: Ctrl-C keeps its usual meaning (KeyboardInterrupt at once)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.requested = False  # Ctrl-C seen, waiting for the next step
        self.stepping = False  # the decoder has reported a step: it will reach check() again
        self.previous: Any = None

    def check(self) -> None:
        """Called from ``on_step``: abort the decode if Ctrl-C was pressed."""
        self.stepping = True
        if self.requested:
            raise AnswerInterrupted

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested or not self.stepping:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> InterruptGuard:
        if self.enabled and threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def stats_line(stats: DecodeStats) -> str:
    return (f"{stats.tokens} tokens · {stats.tps:.1f} tokens/s · {stats.tpf:.2f} tokens/forward · "
            f"{stats.forwards} forwards · {stats.seconds:.2f} s")


class ChatApp:
    def __init__(self, session: ChatSession, out: Console, err: Console, *, strict: bool = False):
        self.session = session
        self.out = out  # answers
        self.info = out if out.is_terminal else err  # everything else
        self.live = out.is_terminal
        self.strict = strict
        self.pieces = PieceCache(session.loaded.tokenizer)
        self.answered = 0  # answers printed so far
        self.failures = 0  # refused or unknown commands, questions that could not be answered
        self.interactive = False  # set by run_interactive: Ctrl-C stops only the answer

    # -- lines -------------------------------------------------------------------------------

    def handle(self, line: str) -> bool:
        """Answer a question or run a command; False when the chat should end."""
        line = line.strip()
        if not line:
            return True
        if line.startswith("/"):
            return self.command(line)
        self.answer(line)
        return True

    def run_lines(self, lines: Iterable[str]) -> list[int]:
        """Handle each line until the end or ``/quit``; the numbers (from 1) of the lines that failed."""
        failed: list[int] = []
        for number, line in enumerate(lines, 1):
            before = self.failures
            go_on = self.handle(line)
            if self.failures > before:
                failed.append(number)
            if not go_on:
                break
        return failed

    def run_interactive(self) -> None:
        self.notice(Text.assemble(("refusion chat", "bold"), f" · model {self.session.model_name}"
                                  f" · decoder {self.session.label}"))
        if self.session.system is not None:
            self.notice(Text(f"system: {self.session.system}", style="dim"))
        self.notice("[dim]/help for commands, Ctrl-C stops an answer, Ctrl-D leaves[/]")
        self.interactive = True
        while True:
            try:
                line = self.info.input(Text("you › ", style="bold cyan"))  # the prompt is not an answer
                go_on = self.handle(line)
            except EOFError:  # Ctrl-D at the prompt
                self.info.print()  # ends the prompt's line where the prompt is (stdout may be a file)
                return
            except KeyboardInterrupt:  # at the prompt, or outside an answer's guard (e.g. while it is printed)
                self.info.print()
                self.notice("[dim](/quit or Ctrl-D leaves)[/]")
                continue
            if not go_on:
                return

    # -- answers -----------------------------------------------------------------------------

    def answer(self, question: str) -> ChatAnswer | None:
        try:
            with InterruptGuard(enabled=self.interactive) as guard, \
                    LiveAnswer(self.out, self.pieces, enabled=self.live) as view:
                def on_step(step: Any) -> None:
                    guard.check()
                    view.on_step(step)

                answer = self.session.ask(question, on_step=on_step)
        except (AnswerInterrupted, KeyboardInterrupt):
            if not self.interactive:
                raise  # --prompt or piped stdin: Ctrl-C stops the run (exit 130), no answer is skipped silently
            self.notice("[yellow]answer interrupted[/] [dim](the conversation is unchanged)[/]")
            return None
        except UserError as exc:
            if self.strict:
                raise
            self.failures += 1
            self.notice(Text.assemble(("error: ", "bold red"), str(exc)))
            hint = exc.hint
            if hint is None and self.session.turns:  # e.g. the conversation outgrew the model's context
                hint = f"the {self.session.turns} earlier turn(s) are part of the prompt; /reset forgets them"
            if hint:
                self.notice(Text.assemble(("hint: ", "dim"), hint))
            return None
        if self.answered and not self.live:
            self.out.print()  # off a terminal a blank line separates one answer from the next
        self.out.print(Text(answer.text), soft_wrap=True)  # the text as decoded, no wrapping added
        self.answered += 1
        self.notice(Text(stats_line(answer.stats), style="dim"))
        return answer

    # -- commands ----------------------------------------------------------------------------

    def command(self, line: str) -> bool:
        name, *after = line.split(maxsplit=1)
        rest = after[0] if after else ""  # the line after the command, as typed (a path, a system message)
        name = ALIASES.get(name.lower(), name.lower())
        if name == "/quit":
            return False
        if name == "/reset":
            self.session.reset()
            self.notice("conversation cleared")
        elif name == "/set":
            self.set_option(rest.split(maxsplit=1))
        elif name == "/system":
            self.system(rest)
        elif name in ("/save", "/save!"):
            self.save(rest, replace=name == "/save!")
        elif name == "/stats":
            self.show_stats()
        elif name == "/help":
            self.show_help()
        else:
            self.failures += 1
            self.notice(Text(f"unknown command {name}; /help lists the commands"))
        return True

    def set_option(self, args: list[str]) -> None:
        if len(args) != 2:
            self.failures += 1
            self.notice(Text(f"usage: {COMMANDS['/set'].usage}; settings: {', '.join(self.session.options())}"))
            return
        name, value = args
        try:
            config = self.session.set_option(name, value)
        except UserError as exc:
            self.failures += 1
            self.notice(Text.assemble(("refused: ", "red"), f"{exc}; nothing changed"))
            return
        self.notice(Text(f"{name} = {getattr(config, name)!r}"))

    def system(self, text: str) -> None:
        session = self.session
        if not text:
            shown = "none (/system TEXT sets one)" if session.system is None else session.system
            self.notice(Text(f"system: {shown}"))
            return
        try:
            session.set_system(None if text.lower() == "off" else text)
        except UserError as exc:
            self.failures += 1
            self.notice(Text.assemble(("refused: ", "red"), f"{exc}; nothing changed"))
            return
        said = "removed" if session.system is None else "set"
        self.notice(Text(f"system message {said}; a new conversation starts"))

    def save(self, where: str, *, replace: bool) -> None:
        if not where:
            self.failures += 1
            self.notice(Text(f"usage: {COMMANDS['/save'].usage} (or {COMMANDS['/save!'].usage} to replace a file)"))
            return
        path = Path(where).expanduser()
        try:
            save_transcript(path, self.session.transcript(), replace=replace)
        except FileExists as exc:
            self.failures += 1
            self.notice(Text.assemble(("refused: ", "red"), f"{exc}; /save! {where} replaces it"))
            return
        except UserError as exc:
            self.failures += 1
            self.notice(Text.assemble(("not saved: ", "red"), str(exc)))
            return
        self.notice(Text(f"saved {len(self.session.exchanges)} answer(s) to {path}"))

    def show_stats(self) -> None:
        session = self.session
        settings = " ".join(f"{key}={value}" for key, value in session.options().items())
        turns = f"{session.turns} turn(s) in the conversation" if session.keep_history else \
            "history off: every question is asked on its own"
        self.notice(Text(f"decoder {session.label} on {session.model_name}; {turns}"))
        self.notice(Text(f"settings: {settings}"))
        if session.last is None:
            self.notice("last answer: none yet")
        else:
            self.notice(Text(f"last answer: {stats_line(session.last.stats)} "
                             f"(after a {session.last.prompt_tokens}-token prompt)"))

    def show_help(self) -> None:
        for command in COMMANDS.values():
            self.notice(Text(f"  {command.usage:<18} {command.summary}"))
        self.notice(Text(f"settings for /set: {', '.join(self.session.options())}"))

    def notice(self, message: str | Text) -> None:
        """A line for the user that is not an answer (a ``str`` is Rich markup: only this module's own text)."""
        self.info.print(message, highlight=False, soft_wrap=True)
