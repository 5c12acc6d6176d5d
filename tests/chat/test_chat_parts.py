"""The chat's parts, in-process: the slot canvas, the session's history and settings, output routing."""

from __future__ import annotations

import io
import json
import os
from types import SimpleNamespace

import pytest
from rich.console import Console

from refusion_cli.chat import AnswerInterrupted, ChatApp, ChatSession, SlotCanvas
from refusion_cli.chat.transcript import scratch_path
from refusion_cli.chat.view import MASKED, PALETTE
from refusion_cli.errors import UserError
from refusion_cli.models import load_model
from tests.chat.helpers import EMBEDDED_MISSING, EMBEDDED_SKIP, QUESTION, SYSTEM


@pytest.fixture(scope="module")
def loaded(causal_checkpoint):
    return load_model(str(causal_checkpoint), device="cpu")


def step(offsets: list[int], tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(offsets=offsets, tokens=tokens)


def test_canvas_shows_slots_filling_out_of_order():
    canvas = SlotCanvas(piece=lambda token: chr(ord("a") + token))
    assert canvas.render().plain == MASKED * 8  # nothing committed yet
    canvas.add(step([4, 5, 6, 7], [0, 1, 2, 3]))  # the second slot first
    text = canvas.render()
    assert text.plain == MASKED * 4 + "abcd"
    canvas.add(step([0, 1, 2, 3], [4, 5, 6, 7]))
    text = canvas.render()
    assert text.plain == "efghabcd"
    styles = {text.plain[span.start:span.end]: span.style for span in text.spans}
    assert styles["e"] == PALETTE[1] + " bold" and styles["a"] == PALETTE[0]  # coloured by iteration, newest bold


def test_session_keeps_the_history_and_interrupted_answers_change_nothing(loaded):
    session = ChatSession(loaded, "refusion", {"gen_length": "16"}, model_name="ckpt")
    steps = []
    first = session.ask(QUESTION, on_step=steps.append)
    assert steps and sum(len(s.tokens) for s in steps) >= first.stats.tokens
    assert [m["role"] for m in session.history] == ["user", "assistant"] and session.turns == 1
    second = session.ask("And then?")
    assert second.prompt_tokens > first.prompt_tokens  # the first turn is in the second prompt
    assert session.turns == 2

    def stop(_step):
        raise AnswerInterrupted

    with pytest.raises(AnswerInterrupted):
        session.ask("A third question", on_step=stop)
    assert session.turns == 2 and session.last is second
    session.reset()
    assert session.history == [] and session.last is second


def test_without_history_every_question_is_asked_on_its_own(loaded):
    session = ChatSession(loaded, "refusion", {"gen_length": "16"}, model_name="ckpt", keep_history=False)
    first = session.ask(QUESTION)
    second = session.ask(QUESTION)
    assert session.history == [] and session.turns == 0 and session.last is second
    assert second.prompt_tokens == first.prompt_tokens and second.tokens == first.tokens


def test_set_refuses_bad_values_and_changes_nothing(loaded):
    session = ChatSession(loaded, "refusion", model_name="ckpt")
    before = session.config
    with pytest.raises(UserError, match=r"slot_threshold must be in \[0, 1\]"):
        session.set_option("slot_threshold", "2")
    with pytest.raises(UserError, match="unknown ReFusionConfig option"):
        session.set_option("threshold", "0.5")
    assert session.config is before
    assert session.set_option("slot_threshold", "0.5").slot_threshold == 0.5
    assert session.config.token_threshold == before.token_threshold


def test_when_stdout_is_not_a_terminal_only_answers_go_there(loaded):
    out, err = io.StringIO(), io.StringIO()
    app = ChatApp(ChatSession(loaded, "refusion", {"gen_length": "16"}, model_name="ckpt"),
                  Console(file=out, force_terminal=False, width=200), Console(file=err, width=200))
    for line in (QUESTION, "/set slot_threshold 2", "/stats", "/help"):
        assert app.handle(line)
    assert not app.handle("/quit")
    answer = app.session.last
    assert out.getvalue() == answer.text + "\n"
    app.handle("And then?")  # a second answer: a blank line between the two
    assert out.getvalue() == answer.text + "\n\n" + app.session.last.text + "\n"
    notes = err.getvalue()
    assert f"{answer.stats.tokens} tokens · " in notes and "tokens/forward" in notes
    assert "refused: slot_threshold must be in [0, 1], got 2.0; nothing changed" in notes
    assert "1 turn(s)" in notes and "/reset" in notes


def test_a_masked_diffusion_session_streams_its_steps_to_the_canvas(bidirectional_checkpoint):
    mdm = load_model(str(bidirectional_checkpoint), device="cpu")
    session = ChatSession(mdm, "llada", {"gen_length": "16", "steps": "8", "block_length": "8"}, model_name="mdm")
    canvas = SlotCanvas(piece=lambda token: "x")
    answer = session.ask(QUESTION, on_step=canvas.add)
    assert canvas.iterations == 8 and len(canvas.pieces) == 16  # two tokens a step fill the whole budget
    assert answer.stats.forwards == 8


def test_a_new_gen_length_moves_the_masked_diffusion_steps_and_blocks(bidirectional_checkpoint):
    mdm = load_model(str(bidirectional_checkpoint), device="cpu")
    session = ChatSession(mdm, "llada", {"gen_length": "48"}, model_name="mdm")
    assert (session.config.gen_length, session.config.steps, session.config.block_length) == (48, 48, 48)
    session.set_option("gen_length", "64")
    assert (session.config.steps, session.config.block_length) == (64, 32)
    session.set_option("block_length", "16")  # given by the user: it stays when the length changes
    session.set_option("gen_length", "32")
    assert (session.config.steps, session.config.block_length) == (32, 16)



def test_a_live_view_taller_than_the_terminal_leaves_nothing_behind():
    """Rows past the terminal's height scroll out of reach of the view's erasing, so they must never be drawn."""
    from refusion_cli.chat import LiveAnswer

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=20, height=5, color_system=None)
    with LiveAnswer(console, piece=lambda token: f"row{token}\n") as view:
        for token in range(12):  # twelve rows of answer on a five-row terminal
            view.on_step(step([token], [token]))
    drawn = screen.getvalue()
    assert "row0" in drawn and "row3" in drawn  # the view was up, cropped to the screen
    assert "row4" not in drawn and "row11" not in drawn


def test_leaving_the_chat_writes_nothing_to_a_redirected_stdout(loaded, monkeypatch):
    """`refusion chat > answers.txt` at a terminal: Ctrl-C and Ctrl-D at the prompt end the prompt's line
    where the prompt is (stderr), not in the answers file."""
    out, err = io.StringIO(), io.StringIO()
    app = ChatApp(ChatSession(loaded, "refusion", {"gen_length": "16"}, model_name="ckpt"),
                  Console(file=out, force_terminal=False, width=200), Console(file=err, width=200))
    keys = iter([KeyboardInterrupt, EOFError])

    def press(*args):
        raise next(keys)

    monkeypatch.setattr("builtins.input", press)
    app.run_interactive()
    assert out.getvalue() == ""
    assert "(/quit or Ctrl-D leaves)" in err.getvalue() and err.getvalue().endswith("you › \n")


def test_ctrl_c_outside_the_interactive_chat_stops_the_run(loaded, monkeypatch):
    """With piped lines (or --prompt) an interrupted answer is not skipped in silence: Ctrl-C propagates."""
    out, err = io.StringIO(), io.StringIO()
    session = ChatSession(loaded, "refusion", {"gen_length": "16"}, model_name="ckpt")
    app = ChatApp(session, Console(file=out, width=200), Console(file=err, width=200))
    asked = []

    def interrupted(question, on_step=None):
        asked.append(question)
        raise KeyboardInterrupt

    monkeypatch.setattr(session, "ask", interrupted)
    with pytest.raises(KeyboardInterrupt):
        app.run_lines(["first\n", "second\n"])
    assert asked == ["first"] and out.getvalue() == "" and "interrupted" not in err.getvalue()


def test_piped_lines_report_which_lines_failed(loaded):
    out, err = io.StringIO(), io.StringIO()
    app = ChatApp(ChatSession(loaded, "refusion", {"gen_length": "16"}, model_name="ckpt"),
                  Console(file=out, width=200), Console(file=err, width=200))
    lines = [QUESTION, "\n", "/set slot_threshold 2", "/set slot_threshold", "/frob", "/set slot_threshold 0.5",
             "/stats", QUESTION]
    assert app.run_lines(lines) == [3, 4, 5]
    assert len(out.getvalue().strip().split("\n\n")) == 2  # both questions answered all the same


def test_a_conversation_outgrowing_the_context_says_how_to_go_on(loaded):
    out, err = io.StringIO(), io.StringIO()
    app = ChatApp(ChatSession(loaded, "refusion", {"gen_length": "16"}, model_name="ckpt"),
                  Console(file=out, width=300), Console(file=err, width=300))
    first = app.answer(QUESTION)
    room = (loaded.model.config.max_position_embeddings - first.prompt_tokens) // 8 * 8
    app.handle(f"/set gen_length {room}")  # the question alone fits; with the first turn before it, not
    assert app.answer(QUESTION) is None and app.session.turns == 1
    notes = err.getvalue().splitlines()
    assert "exceeds the model's context of 1024" in notes[-2]
    assert notes[-1] == "hint: the 1 earlier turn(s) are part of the prompt; /reset forgets them"
    app.handle("/reset")
    assert app.answer(QUESTION) is not None


def test_ctrl_c_just_after_an_answer_does_not_leave_the_chat(loaded, monkeypatch):
    """Between the answer's interrupt guard and the next prompt (the answer being printed) Ctrl-C only
    prints the hint, as at the prompt: the conversation is not lost."""
    out, err = io.StringIO(), io.StringIO()
    app = ChatApp(ChatSession(loaded, "refusion", {"gen_length": "16"}, model_name="ckpt"),
                  Console(file=out, width=200), Console(file=err, width=200))
    lines = iter(["/stats"])

    def typed(*args):
        line = next(lines, None)
        if line is None:
            raise EOFError
        return line

    def pressed():
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", typed)
    monkeypatch.setattr(app, "show_stats", pressed)
    app.run_interactive()  # returns at EOF, no KeyboardInterrupt
    assert "(/quit or Ctrl-D leaves)" in err.getvalue()


# -- the system message and /save -------------------------------------------------------------


def template_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The reference: the tokenizer's own rendering of ``messages`` with the generation prompt."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def system(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


def chat_app(session: ChatSession) -> tuple[ChatApp, io.StringIO]:
    """An app off a terminal; returns it and what it printed besides answers."""
    err = io.StringIO()
    return ChatApp(session, Console(file=io.StringIO(), width=300), Console(file=err, width=300)), err


@pytest.mark.skipif(EMBEDDED_MISSING, reason=EMBEDDED_SKIP)
def test_the_prompt_with_a_system_message_is_the_template_rendering(monkeypatch):
    """What the decoder gets is exactly apply_chat_template([system, user, ...], add_generation_prompt=True) of
    the embedded tokenizer's Qwen3-style template, the system message first in every prompt."""
    from refusion_cli.chat import session as session_module

    embedded = load_model("refusion-tiny", device="cpu")
    tokenizer = embedded.tokenizer
    decoded_after: list[list[int]] = []  # the prompt of every decode call
    run_decoder = session_module.run_decoder

    def recording(decoder, model, prompt_ids, *args, **kwargs):
        decoded_after.append(list(prompt_ids))
        return run_decoder(decoder, model, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(session_module, "run_decoder", recording)
    session = ChatSession(embedded, "refusion", {"gen_length": "32"}, model_name="refusion-tiny", system=SYSTEM)
    first = session.ask(QUESTION)
    second = session.ask("And then?")
    assert decoded_after == [
        template_ids(tokenizer, [system(SYSTEM), user(QUESTION)]),
        template_ids(tokenizer, [system(SYSTEM), user(QUESTION), {"role": "assistant", "content": first.text},
                                 user("And then?")]),
    ]
    assert second.prompt_tokens == len(decoded_after[1])
    assert tokenizer.decode(decoded_after[0]).startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user")


def test_reset_keeps_the_system_message_and_system_starts_a_new_conversation(loaded):
    session = ChatSession(loaded, "refusion", {"gen_length": "16"}, model_name="ckpt", system=SYSTEM)
    app, err = chat_app(session)
    app.handle(QUESTION)
    app.handle("/reset")
    assert session.system == SYSTEM and session.turns == 0
    assert session.prompt_ids(QUESTION) == template_ids(loaded.tokenizer, [system(SYSTEM), user(QUESTION)])
    app.handle(QUESTION)
    app.handle("/system   Answer with the number only.  ")
    assert session.system == "Answer with the number only." and session.turns == 0 and session.history == []
    assert session.prompt_ids(QUESTION) == template_ids(loaded.tokenizer,
                                                        [system("Answer with the number only."), user(QUESTION)])
    app.handle("/system")
    app.handle("/system off")
    assert session.system is None
    assert session.prompt_ids(QUESTION) == template_ids(loaded.tokenizer, [user(QUESTION)])
    app.handle("/system")
    notes = err.getvalue().splitlines()
    assert [note for note in notes if "system" in note] == [
        "system message set; a new conversation starts",
        "system: Answer with the number only.",
        "system message removed; a new conversation starts",
        "system: none (/system TEXT sets one)",
    ]
    assert app.failures == 0


def test_a_template_without_a_system_role_refuses_it_and_changes_nothing(no_system_checkpoint):
    loaded = load_model(str(no_system_checkpoint), device="cpu")
    with pytest.raises(UserError, match="cannot render a system message: System role not supported"):
        ChatSession(loaded, "refusion", {"gen_length": "16"}, model_name="ckpt", system=SYSTEM)
    session = ChatSession(loaded, "refusion", {"gen_length": "16"}, model_name="ckpt")
    app, err = chat_app(session)
    app.handle(QUESTION)
    app.handle(f"/system {SYSTEM}")
    assert session.system is None and session.turns == 1 and app.failures == 1  # the conversation goes on
    assert err.getvalue().splitlines()[-1] == ("refused: the chat template of ckpt cannot render a system message: "
                                               "System role not supported; nothing changed")


def test_save_refuses_an_existing_file_and_save_bang_replaces_it(loaded, tmp_path):
    target = tmp_path / "chat.json"
    target.write_text("an earlier conversation\n")
    app, err = chat_app(ChatSession(loaded, "refusion", {"gen_length": "16"}, model_name="ckpt"))
    app.handle(QUESTION)
    assert app.handle(f"/save {target}")
    assert target.read_text() == "an earlier conversation\n" and app.failures == 1
    assert err.getvalue().splitlines()[-1] == f"refused: {target} already exists; /save! {target} replaces it"
    app.handle(f"/save! {target}")
    record = json.loads(target.read_text(encoding="utf-8"))
    assert record["system"] is None
    assert record["messages"] == [user(QUESTION), {"role": "assistant", "content": app.session.last.text}]
    assert err.getvalue().splitlines()[-1] == f"saved 1 answer(s) to {target}" and app.failures == 1
    assert [path.name for path in tmp_path.iterdir()] == ["chat.json"]  # no scratch file left behind


def test_a_path_that_cannot_be_written_is_one_line_and_the_chat_goes_on(loaded, tmp_path):
    app, err = chat_app(ChatSession(loaded, "refusion", {"gen_length": "16"}, model_name="ckpt"))
    app.handle(QUESTION)
    no_folder = tmp_path / "no-such-folder" / "chat.json"
    too_long = tmp_path / ("x" * 300 + ".json")
    blocked = tmp_path / "blocked.json"
    scratch_path(blocked).mkdir()  # the scratch file cannot be created: the write itself fails
    for target in (no_folder, too_long, tmp_path, blocked, ""):
        assert app.handle(f"/save {target}")
    assert err.getvalue().splitlines()[-5:] == [
        f"not saved: cannot write {no_folder}: there is no folder {no_folder.parent}",
        f"not saved: cannot write {too_long}: File name too long",
        f"not saved: {tmp_path} is a folder, not a file",
        f"not saved: cannot write {blocked}: Is a directory",
        "usage: /save PATH (or /save! PATH to replace a file)",
    ]
    assert not blocked.exists() and app.failures == 5
    assert app.answer("And then?") is not None and app.session.turns == 2  # the chat went on
    assert os.listdir(tmp_path) == [scratch_path(blocked).name]
