"""`refusion chat` through a real pseudo-terminal (pexpect), with --prompt, and with piped stdin.

The tiny checkpoint is random, so its answers are noise; what is checked is the chat's behaviour:
a live view then an answer and a stats line, /set refusing bad values, /reset, /quit, Ctrl-C
stopping an answer without leaving, Ctrl-D leaving, --system and /save / --save. Some tests ask the
embedded refusion-tiny a question of the synthetic task and check its answer.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from refusion_cli.tasks.synthetic import is_correct, read_jsonl
from tests.chat.helpers import EMBEDDED_MISSING, EMBEDDED_SKIP, QUESTION, SYSTEM
from tests.envs import cache_env

REPO = Path(__file__).resolve().parents[2]
STATS = r"\d+ tokens · [\d.]+ tokens/s · [\d.]+ tokens/forward · \d+ forwards · [\d.]+ s"
STATS_NUMBERS = re.compile(r"(\d+) tokens · [\d.]+ tokens/s · ([\d.]+) tokens/forward · (\d+) forwards")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

# The held-out problem asked of the embedded model (index into evals/synthetic/test.jsonl):
# one that refusion-tiny answers correctly.
# refusion-tiny answers about two thirds of the held-out problems with ReFusion decoding (docs/training.md,
# "The embedded models"); with chat's default settings it answers 13 of the first 20 (problems 0-3, 6-9,
# 11-13, 15 and 16: measured, not assumed), problem 7 among them.
EMBEDDED_QUESTION_INDEX = 7


def cli_env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", **cache_env(), **extra}


def spawn_chat(*args: str) -> pexpect.spawn:
    """The chat on a 40 x 120 pseudo-terminal, colours off (the live view and the layout stay)."""
    return pexpect.spawn(sys.executable, ["-m", "refusion_cli", "chat", *args], cwd=str(REPO),
                         env=cli_env(TERM="xterm-256color", NO_COLOR="1"), encoding="utf-8", timeout=120,
                         dimensions=(40, 120))


def run_chat(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refusion_cli", "chat", *args], input=stdin, capture_output=True,
                          text=True, env=cli_env(), cwd=REPO, timeout=300,
                          stdin=subprocess.DEVNULL if stdin is None else None)


@pytest.mark.slow  # `make test-all` (a terminal session of its own); by default the embedded model's session
# below runs in a terminal, and Ctrl-C is checked in a piped run and in tests/chat/test_chat_parts.py
def test_ctrl_c_stops_an_answer_and_ctrl_d_leaves(causal_checkpoint):
    # a long budget and thresholds of 1 (one slot per iteration, every slot through the completion
    # rounds), so the answer is still being decoded when Ctrl-C arrives, even on a fast machine
    child = spawn_chat("--model", str(causal_checkpoint), "--set", "gen_length=960", "--set", "slot_size=4",
                       "--set", "slot_threshold=1", "--set", "token_threshold=1")
    child.expect("you › ")
    child.sendline(QUESTION)
    child.expect("░")  # the live view is up, still-masked positions shown: decoding has started
    child.sendintr()
    child.expect("answer interrupted")
    child.expect("you › ")
    child.sendline("/stats")
    child.expect(r"0 turn\(s\) in the conversation")  # the interrupted answer did not join the history
    child.expect("last answer: none yet")
    child.expect("you › ")
    child.sendintr()  # at the prompt: a hint, the chat goes on
    child.expect(re.escape("(/quit or Ctrl-D leaves)"))
    child.expect("you › ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_prompt_mode_prints_the_answer_and_exits(causal_checkpoint, monkeypatch, capsys):
    """In-process, for speed (the command runs as a process of its own in the terminal tests)."""
    code, out = run_main(monkeypatch, capsys, "--model", str(causal_checkpoint), "--set", "gen_length=32",
                         "--prompt", QUESTION)
    assert code == 0, out.err
    assert out.out.strip()  # the answer, alone on stdout
    assert re.search(STATS, out.err) and "░" not in out.out + out.err  # no live view off a terminal


def test_piped_stdin_answers_each_line_and_exits_at_eof(causal_checkpoint, monkeypatch, capsys):
    lines = f"{QUESTION}\n\n/set slot_threshold 0.5\nHow many apples does Mia have?\n"
    code, out = run_main(monkeypatch, capsys, "--model", str(causal_checkpoint), "--set", "gen_length=32",
                         stdin=io.StringIO(lines))
    assert code == 0, out.err
    assert len(re.findall(STATS, out.err)) == 2  # two questions, two answers; the blank line is skipped
    assert "slot_threshold = 0.5" in out.err
    assert "Traceback" not in out.err


def test_piped_stdin_with_a_bad_line_goes_on_then_exits_2(causal_checkpoint, monkeypatch, capsys):
    lines = f"/set slot_threshold 7\n{QUESTION}\n/frob\n"
    code, out = run_main(monkeypatch, capsys, "--model", str(causal_checkpoint), "--set", "gen_length=32",
                         stdin=io.StringIO(lines))
    assert code == 2, out.err
    assert len(re.findall(STATS, out.err)) == 1 and out.out.strip()  # the question was still answered
    assert "refused: slot_threshold must be in [0, 1], got 7.0; nothing changed" in out.err
    assert out.err.splitlines()[-1] == "error: input lines 1, 3 failed (reported above)"
    assert "Traceback" not in out.err


@pytest.mark.parametrize("args, message", [
    (["--set", "slot_threshold=2"], "slot_threshold must be in [0, 1]"),
    (["--decoder", "beam"], "unknown decoder 'beam'"),
    (["--decoder", "llada"], "needs a bidirectional (masked-diffusion) model"),
    (["--set", "slot_threshold=0.8", "--set", "slot_threshold=0.9"],
     "--set gives slot_threshold two values: 0.8 and 0.9"),
    (["--model", ""], "Invalid value for '--model': the value is empty"),  # not the default model instead
    (["--device", ""], "Invalid value for '--device': the value is empty"),
    (["--seed", str(2**70)], "Invalid value for '--seed': must be a whole number from 0 to 9223372036854775807"),
    (["--system", ""], "Invalid value for '--system': the value is empty"),
    (["--system", "Be brief.", "--system-file", "system.txt"],
     "--system and --system-file both give the system message; pick one"),
    (["--system-file", "/no/such/system.txt"],
     "cannot read --system-file /no/such/system.txt: No such file or directory"),
    (["--save", "/no/such/folder/chat.json"], "--save: cannot write /no/such/folder/chat.json: there is no folder"),
    (["--decoder", "ar", "--recheck"],
     "--recheck applies to the refusion decoder, which is not among the decoders given (ar)"),
])
def test_bad_options_are_one_line_and_exit_2(args, message, causal_checkpoint, monkeypatch, capsys):
    """Through the real entry point (in-process, for speed)."""
    from refusion_cli.cli.app import main

    monkeypatch.setattr(sys, "argv", ["refusion", "chat", "--model", str(causal_checkpoint), *args,
                                      "--prompt", QUESTION])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out = capsys.readouterr()
    assert exit_info.value.code == 2 and message in " ".join(out.err.split())
    assert len([line for line in out.err.splitlines() if line.startswith("error:")]) == 1
    assert "Traceback" not in out.err and out.out == ""


def test_a_decoder_that_does_not_fit_is_refused_before_the_weights_load(causal_checkpoint, monkeypatch, capsys):
    """As eval and bench do: the checkpoint's record is checked against the decoder first, nothing is loaded."""
    from refusion_cli.cli import chat
    from refusion_cli.cli.app import main

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the decoder's fit was checked")

    monkeypatch.setattr(chat, "load_model", no_load)
    monkeypatch.setattr(sys, "argv", ["refusion", "chat", "--model", str(causal_checkpoint), "--decoder", "llada",
                                      "--prompt", QUESTION])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = " ".join(capsys.readouterr().err.split())
    assert exit_info.value.code == 2 and "the llada decoder needs a bidirectional (masked-diffusion) model" in err


@pytest.fixture(scope="module")
def embedded_problem() -> dict[str, str]:
    return read_jsonl(REPO / "evals" / "synthetic" / "test.jsonl")[EMBEDDED_QUESTION_INDEX]


@pytest.mark.skipif(EMBEDDED_MISSING, reason=EMBEDDED_SKIP)
def test_embedded_refusion_tiny_answers_in_the_terminal_and_obeys_commands(embedded_problem):
    """One terminal session, one process start and model load for both checks: the default model answers a
    question of the synthetic task, then /set refuses a bad value, /stats, /reset, /quit. (The live view's
    still-masked positions: the Ctrl-C test above waits for them.)"""
    child = spawn_chat()  # the default model: refusion-tiny
    child.expect("you › ")
    child.sendline(embedded_problem["question"])
    child.expect(STATS)
    final = ANSI.sub("", child.before.split("\x1b[2K")[-1])  # what is left once the live view is cleared
    assert is_correct(final, embedded_problem["target"]), final
    assert f"#### {embedded_problem['target']}" in final
    child.expect("you › ")
    child.sendline("/set slot_threshold 2")
    child.expect(re.escape("refused: slot_threshold must be in [0, 1], got 2.0; nothing changed"))
    child.expect("you › ")
    child.sendline("/stats")
    child.expect(r"slot_threshold=0\.9 ")  # unchanged
    child.expect(r"last answer: " + STATS)
    child.expect("you › ")
    child.sendline("/set slot_threshold 0.5")
    child.expect(re.escape("slot_threshold = 0.5"))
    child.expect("you › ")
    child.sendline("/stats")
    child.expect(r"1 turn\(s\) in the conversation")
    child.expect(r"slot_threshold=0\.5 ")
    child.expect("you › ")
    child.sendline("/reset")
    child.expect("conversation cleared")
    child.expect("you › ")
    child.sendline("/stats")
    child.expect(r"0 turn\(s\) in the conversation")
    child.expect("you › ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.slow  # `make test-all`; --prompt mode runs by default on a random checkpoint, and the embedded model above
@pytest.mark.skipif(EMBEDDED_MISSING, reason=EMBEDDED_SKIP)
def test_embedded_refusion_tiny_answers_with_prompt(embedded_problem):
    out = run_chat("--prompt", embedded_problem["question"])
    assert out.returncode == 0, out.stderr
    assert is_correct(out.stdout, embedded_problem["target"]), out.stdout


@pytest.mark.slow  # `make test-all`; piped lines run by default on a random checkpoint
@pytest.mark.skipif(EMBEDDED_MISSING, reason=EMBEDDED_SKIP)
def test_embedded_refusion_tiny_answers_a_file_of_questions_without_history(embedded_problem):
    """Two independent questions on stdin: each answered on its own, the answers a blank line apart."""
    out = run_chat("--no-history", stdin=f"{embedded_problem['question']}\n{embedded_problem['question']}\n")
    assert out.returncode == 0, out.stderr
    answers = out.stdout.strip().split("\n\n")
    assert len(answers) == 2 and answers[0] == answers[1]
    assert is_correct(answers[1], embedded_problem["target"]), answers[1]


@pytest.mark.skipif(EMBEDDED_MISSING, reason=EMBEDDED_SKIP)
def test_the_variant_flags_decode_with_the_toolkits_variants(tmp_path, monkeypatch, capsys):
    """Held-out problem 4, which the paper's decoder gets wrong with the paper's k and b and the three variants
    together get right (measured); the saved conversation says which variant answered."""
    problem = read_jsonl(REPO / "evals" / "synthetic" / "test.jsonl")[4]
    paper, variants = tmp_path / "paper.json", tmp_path / "variants.json"
    papers_k_b = ("--set", "slot_size=8", "--set", "block_size=none")  # not refusion-tiny's own k=4, b=32
    code, out = run_main(monkeypatch, capsys, "--prompt", problem["question"], "--save", str(paper), *papers_k_b)
    assert code == 0 and not is_correct(out.out, problem["target"]), out.out
    code, out = run_main(monkeypatch, capsys, "--prompt", problem["question"], "--save", str(variants),
                         "--causal-fix", "--causal-first", "--recheck", *papers_k_b)
    assert code == 0 and is_correct(out.out, problem["target"]), out.out
    assert "variant" not in json.loads(paper.read_text(encoding="utf-8"))
    record = json.loads(variants.read_text(encoding="utf-8"))
    assert (record["decoder"], record["variant"]) == ("refusion", {"causal_fix": True, "causal_first": True,
                                                                   "recheck": True})


def test_any_mix_of_variant_flags_decodes_and_is_recorded(causal_checkpoint, tmp_path, monkeypatch, capsys):
    saved = tmp_path / "chat.json"
    code, out = run_main(monkeypatch, capsys, "--model", str(causal_checkpoint), "--prompt", QUESTION,
                         "--set", "gen_length=32", "--causal-first", "--recheck", "--save", str(saved))
    assert code == 0, out.err
    assert json.loads(saved.read_text(encoding="utf-8"))["variant"] == {"causal_fix": False, "causal_first": True,
                                                                        "recheck": True}


def run_main(monkeypatch, capsys, *args: str, stdin: object = None) -> tuple[int, object]:
    """`refusion chat ARGS` through the real entry point, in-process (for speed); stdin replaced when given."""
    from refusion_cli.cli.app import main

    monkeypatch.setattr(sys, "argv", ["refusion", "chat", *args])
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", stdin)
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, capsys.readouterr()


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])  # a UTF-8 locale; the C locale
def test_piped_bytes_that_are_not_utf8_are_read_not_fatal(errors, causal_checkpoint, monkeypatch, capsys):
    stdin = io.TextIOWrapper(io.BytesIO(b"Mia has 3 \xff\xfe apples. How many apples does Mia have?\n"),
                             encoding="utf-8", errors=errors)
    code, out = run_main(monkeypatch, capsys, "--model", str(causal_checkpoint), "--set", "gen_length=16",
                         stdin=stdin)
    assert code == 0, out.err
    assert re.search(STATS, out.err) and out.out.strip()


def test_prompt_is_a_question_even_when_it_starts_with_a_slash(causal_checkpoint, monkeypatch, capsys):
    code, out = run_main(monkeypatch, capsys, "--model", str(causal_checkpoint), "--set", "gen_length=16",
                         "--prompt", "/quit")
    assert code == 0, out.err
    assert re.search(STATS, out.err) and out.out.endswith("\n")  # answered (the random model's text may be empty)


def test_a_checkpoint_without_a_chat_template_is_one_error_line(causal_checkpoint, tmp_path, monkeypatch, capsys):
    import shutil

    model = Path(shutil.copytree(causal_checkpoint, tmp_path / "no-template"))
    (model / "chat_template.jinja").unlink()
    code, out = run_main(monkeypatch, capsys, "--model", str(model), "--decoder", "ar", "--prompt", QUESTION)
    assert code == 2 and out.out == ""
    assert out.err.splitlines() == [
        f"error: the tokenizer of '{model}' has no chat template; prompts are rendered as chat turns (hint: use a "
        "chat (instruct) checkpoint, or give its tokenizer a chat_template (chat_template.jinja))"]


class InterruptedLines:
    """Piped stdin whose reader gets Ctrl-C after ``lines``."""

    def __init__(self, *lines: str):
        self.lines = lines

    def isatty(self) -> bool:
        return False

    def __iter__(self):
        yield from self.lines
        raise KeyboardInterrupt


def test_ctrl_c_in_a_piped_run_still_saves_the_answers_so_far(causal_checkpoint, tmp_path, monkeypatch, capsys):
    target = tmp_path / "chat.json"
    code, out = run_main(monkeypatch, capsys, "--model", str(causal_checkpoint), "--set", "gen_length=16",
                         "--save", str(target), stdin=InterruptedLines(QUESTION + "\n", "What is 2 + 2?\n"))
    assert code == 130 and out.err.splitlines()[-1] == "error: interrupted"
    saved = json.loads(target.read_text(encoding="utf-8"))
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == [QUESTION, "What is 2 + 2?"]
    assert len(saved["stats"]) == 2 and f"saved 2 answer(s) to {target}" in " ".join(out.err.split())


def test_a_closed_stdin_is_one_error_line(causal_checkpoint, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", None)
    code, out = run_main(monkeypatch, capsys, "--model", str(causal_checkpoint))
    assert code == 2 and out.err.startswith("error: stdin is closed") and out.out == ""


@pytest.mark.slow  # `make test-all`; Ctrl-C during an interactive answer runs by default
def test_ctrl_c_during_a_prompt_answer_exits_130(causal_checkpoint):
    """--prompt is not the chat: Ctrl-C stops the command (no exit 0 with an empty answer)."""
    child = spawn_chat("--model", str(causal_checkpoint), "--set", "gen_length=960", "--set", "slot_size=4",
                       "--set", "slot_threshold=1", "--set", "token_threshold=1", "--prompt", QUESTION)
    child.expect("░")  # decoding has started
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130 and "Traceback" not in child.before
    assert re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", child.before).rstrip().endswith("error: interrupted")
    assert "answer interrupted" not in child.before


# -- the system message and saving the conversation ------------------------------------------


def stats_of(stderr: str) -> list[dict[str, float | int]]:
    """tokens, tokens per forward (as shown: two decimals) and forwards of every stats line."""
    return [{"tokens": int(tokens), "tpf": float(tpf), "forwards": int(forwards)}
            for tokens, tpf, forwards in STATS_NUMBERS.findall(stderr)]


def shown(stats: list[dict[str, float | int]]) -> list[dict[str, float | int]]:
    """A transcript's stats as the stats line shows them."""
    return [{"tokens": s["tokens"], "tpf": round(s["tpf"], 2), "forwards": s["forwards"]} for s in stats]


@pytest.mark.skipif(EMBEDDED_MISSING, reason=EMBEDDED_SKIP)
def test_save_writes_two_piped_turns_of_the_embedded_model(embedded_problem, tmp_path, monkeypatch, capsys):
    """/save in a piped conversation, and --save at its end, write the same record: the model, the decoder,
    the settings in use (one changed by /set), the system message, the four messages, each answer's stats."""
    saved, at_end = tmp_path / "chat.json", tmp_path / "at-end.json"
    follow_up = "And if she eats 2 of them?"
    lines = f"/set slot_threshold 0.8\n{embedded_problem['question']}\n{follow_up}\n/save {saved}\n"
    code, out = run_main(monkeypatch, capsys, "--system", SYSTEM, "--save", str(at_end), "--set", "gen_length=128",
                         stdin=io.StringIO(lines))
    assert code == 0, out.err
    record = json.loads(saved.read_text(encoding="utf-8"))
    answers = [message["content"] for message in record["messages"][1::2]]
    assert out.out == "\n\n".join(answers) + "\n"  # the answers as printed
    assert record == {
        "model": "refusion-tiny",
        "decoder": "refusion",
        "config": {"gen_length": 128, "slot_size": 4, "block_size": 32, "slot_threshold": 0.8,  # synthetic_tiny's k, b
                   "token_threshold": 0.9, "temperature": 0.0},
        "seed": 0,
        "history": True,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": embedded_problem["question"]},
                     {"role": "assistant", "content": answers[0]},
                     {"role": "user", "content": follow_up},
                     {"role": "assistant", "content": answers[1]}],
        "stats": record["stats"],  # timings vary; the counts are checked against the stats lines below
    }
    assert shown(record["stats"]) == stats_of(out.err) and len(record["stats"]) == 2
    assert record["stats"][1]["prompt_tokens"] > record["stats"][0]["prompt_tokens"]  # the first turn is in it
    assert all(answer["tps"] > 0 and answer["seconds"] > 0 for answer in record["stats"])
    assert json.loads(at_end.read_text(encoding="utf-8")) == record
    assert f"saved 2 answer(s) to {saved}" in out.err and f"saved 2 answer(s) to {at_end}" in out.err


def test_save_with_prompt_writes_the_answer_and_never_replaces_a_file(causal_checkpoint, tmp_path, monkeypatch,
                                                                       capsys):
    system_file = tmp_path / "system.txt"
    system_file.write_text(f"{SYSTEM}\n", encoding="utf-8")
    target = tmp_path / "answer.json"
    args = ("--model", str(causal_checkpoint), "--set", "gen_length=16", "--system-file", str(system_file),
            "--prompt", QUESTION, "--save", str(target))
    code, out = run_main(monkeypatch, capsys, *args)
    assert code == 0, out.err
    record = json.loads(target.read_text(encoding="utf-8"))
    assert record["system"] == SYSTEM and record["config"]["gen_length"] == 16
    assert record["messages"] == [{"role": "user", "content": QUESTION},
                                  {"role": "assistant", "content": out.out.removesuffix("\n")}]
    assert shown(record["stats"]) == stats_of(out.err) and len(record["stats"]) == 1
    before = target.read_bytes()
    code, out = run_main(monkeypatch, capsys, *args)  # the same again: refused before the model loads
    assert code == 2 and out.out == "" and target.read_bytes() == before
    assert out.err.splitlines() == [f"error: --save: {target} already exists (hint: --save never replaces a file: "
                                    "remove it or choose another path)"]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc, a folder no one can create a file in")
def test_save_into_a_folder_that_takes_no_file_is_refused_before_any_answer(causal_checkpoint, monkeypatch, capsys):
    """Found at the end, the error would lose the whole piped conversation: it is found before the model loads."""
    code, out = run_main(monkeypatch, capsys, "--model", str(causal_checkpoint), "--set", "gen_length=16",
                         "--save", "/proc/chat.json", stdin=io.StringIO(f"{QUESTION}\n"))
    assert code == 2 and out.out == ""  # nothing was answered
    [line] = out.err.splitlines()
    assert line.startswith("error: --save: cannot write /proc/chat.json: ")


def test_a_template_that_cannot_render_a_system_message_is_one_error_line(no_system_checkpoint, monkeypatch,
                                                                          capsys):
    code, out = run_main(monkeypatch, capsys, "--model", str(no_system_checkpoint), "--system", SYSTEM,
                         "--prompt", QUESTION)
    assert code == 2 and out.out == ""
    assert out.err.splitlines() == [f"error: the chat template of {no_system_checkpoint} cannot render a system "
                                    "message: System role not supported"]


@pytest.mark.slow  # `make test-all`; a system message and --save run by default in the tests above
def test_interactive_chat_with_a_system_message_saves_the_conversation(causal_checkpoint, tmp_path):
    target = tmp_path / "chat.json"
    child = spawn_chat("--model", str(causal_checkpoint), "--set", "gen_length=32", "--system", SYSTEM)
    child.expect(re.escape(f"system: {SYSTEM}"))  # under the banner
    child.expect("you › ")
    child.sendline(QUESTION)
    child.expect(STATS)
    child.expect("you › ")
    child.sendline(f"/save {target}")
    child.expect(re.escape(f"saved 1 answer(s) to {target}"))
    child.expect("you › ")
    child.sendline(f"/save {target}")
    child.expect(re.escape(f"refused: {target} already exists; /save! {target} replaces it"))
    child.expect("you › ")
    child.sendline("/help")
    child.expect(re.escape("/save! PATH"))
    child.expect("you › ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    record = json.loads(target.read_text(encoding="utf-8"))
    assert record["system"] == SYSTEM and record["config"]["gen_length"] == 32
    assert [message["role"] for message in record["messages"]] == ["user", "assistant"]
    assert record["messages"][0]["content"] == QUESTION and len(record["stats"]) == 1
