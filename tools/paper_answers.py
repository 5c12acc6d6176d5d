"""Unusual answers, given as token ids, for the differential check of ``--protocol paper``'s answer handling.

Each answer is a list of pieces: ordinary text (tokenised with special-token text spelled by ordinary
tokens, as a model can write ``<|endoftext|>`` letter by letter; text that NFC would change is
spelled byte by byte, as a model emits it without passing the tokenizer's normaliser), a special
token by its content, or one raw byte (its byte-level token: a multi-byte character cut in two). Pieces make the same
text with any byte-level BPE of Qwen3's vocabulary: the golden run tokenises them with Qwen3's own
tokenizer, the offline test with the byte-level stand-in (``paper_parity.byte_level_tokenizer``).

The classes tried, on every benchmark where they apply:

- A: an end token other than the tokenizer's EOS inside the answer (``<|endoftext|>``), text after it;
- B: special-token text spelled with ordinary tokens (``<|endoftext|>``, ``<|im_end|>``, ``</s>``);
- C: a stop string split by a special token (``Quest<|im_start|>ion:``, ``[DO<|endoftext|>NE]``);
- D: Unicode the tokenizer's NFC normaliser changes (combining marks), and some it does not
  (full-width letters, ligatures, zero-width spaces), a multi-byte character cut at the end;
- E: code importing third-party packages (numpy, sympy) and a missing one;
- F: LaTeX the MATH parsers' versions treat differently (``\\%``, ``\\$``, ``\\text{}``);
- others: no EOS at all (the budget ran out), EOS first, ``<think>`` tokens, thinking with a special
  token inside, answers after the EOS.

``python tools/paper_parity.py golden --answers adversarial ...`` scores them with the paper's own
harness (see ``paper_parity``); ``tests/harness/test_answer_parity.py`` scores them with the toolkit.
"""

from __future__ import annotations

import unicodedata
from typing import Any

Piece = dict[str, Any]  # {"text": str} | {"special": str} | {"byte": int}


def last_boxed(text: str) -> str:
    """The content of the last ``\\boxed{...}`` of ``text`` (braces balanced), or ``""``."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return ""
    depth, index = 0, start + len("\\boxed")
    for position in range(index, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[index + 1:position]
    return ""


def T(text: str) -> Piece:  # noqa: N802  (short constructors keep the answer lists readable)
    return {"text": text}


def S(token: str) -> Piece:  # noqa: N802
    return {"special": token}


def B(value: int) -> Piece:  # noqa: N802
    return {"byte": value}


EOT, IM_END, IM_START = S("<|endoftext|>"), S("<|im_end|>"), S("<|im_start|>")
MATH_PER_SUBJECT = 10  # MATH: answers on the first ten documents of each subject


def _byte_tokens() -> dict[int, str]:
    """The byte-level alphabet: byte -> the character its base token is spelled with (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for value in range(256):
        if value in printable:
            table[value] = chr(value)
        else:
            table[value] = chr(256 + extra)
            extra += 1
    return table


def piece_ids(tokenizer: Any, pieces: list[Piece]) -> list[int]:
    """The token ids of ``pieces`` under ``tokenizer`` (a byte-level BPE with Qwen3's added tokens)."""
    ids: list[int] = []
    bytes_table = _byte_tokens()
    for piece in pieces:
        if "text" in piece and unicodedata.normalize("NFC", piece["text"]) != piece["text"]:
            # a model emits tokens, not text: spelled byte by byte, the tokenizer's NFC normaliser does not apply
            ids += [tokenizer.convert_tokens_to_ids(bytes_table[value]) for value in piece["text"].encode("utf-8")]
        elif "text" in piece:
            ids += tokenizer(piece["text"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        elif "special" in piece:
            ids.append(tokenizer.convert_tokens_to_ids(piece["special"]))
        else:
            ids.append(tokenizer.convert_tokens_to_ids(bytes_table[piece["byte"]]))
    return ids


def until_eos(ids: list[int], eos: int) -> list[int]:
    """The paper's decoder output: the ids up to and including the first EOS (all of them without one)."""
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def adversarial_answers(benchmark: str, doc: dict[str, Any]) -> list[list[Piece]]:
    """The unusual answers for one document of ``benchmark`` (the document's index picks one)."""
    think = [S("<think>"), T("\nHmm."), EOT, T(" still thinking\n"), S("</think>"), T("\n\n")]
    if benchmark == "arc_challenge":
        gold = doc["answerKey"]
        wrong = "B" if gold != "B" else "C"
        return [
            [T(f" {wrong}"), EOT, T(f" or maybe {gold}."), IM_END],  # A
            [T(f" {gold}"), EOT, T("."), IM_END], [T(f" {gold}<|endoftext|>."), IM_END],  # A, B
            [T(f" {gold}<|im_end|> {wrong}"), IM_END], [T(f" {gold}</s>"), IM_END],  # B
            [T(f" {gold}"), S("<|im_start|>"), T("\n\nNo."), IM_END],  # C
            [T(f" {gold}\u0307."), IM_END], [T(f" {gold}\u0301"), IM_END],  # D: combining marks
            [T(" \uff22."), IM_END], [T(f"\u200b{gold}."), IM_END], [T(f" {gold}"), B(0xe2), B(0x82)],  # D
            [T(f" {gold}")], [IM_END, T(f" {gold}")], [*think, T(f"{gold}."), IM_END],  # others
            [T(f"\n\n{gold}"), EOT, IM_END], [EOT, T(f" {gold}"), IM_END], [T(f" {gold}"), IM_END, T(f" {wrong}")],
            [T(f" {gold}"), S("<|fim_middle|>"), T("."), IM_END], [T(f" {gold}\r\n\r\n{wrong}"), IM_END],
            [T(f" e\u0301 {gold}."), IM_END],
            [T(" C"), EOT, T(" or maybe A.")], [T(" B<|endoftext|>.")],  # A, B: the class examples of evals/README.md, no EOS
        ]
    if benchmark == "mmlu_pro":
        gold = doc["answer"]
        wrong = "A" if gold != "A" else "B"
        return [
            [T(f"The answer is ({wrong})."), EOT, T(f" Sorry, the answer is ({gold})."), IM_END],  # A
            [T(f"The answer is ({gold})<|endoftext|>."), IM_END],  # B
            [T("Quest"), IM_START, T(f"ion: restated. The answer is ({gold})."), IM_END],  # C
            [T("Quest"), EOT, T(f"ion: the answer is ({gold})."), IM_END],  # C with the end token
            [T(f"The answer is ({gold}\u0307)."), IM_END], [T(f"The answer is ({gold}\u0323)."), IM_END],  # D
            [T("The answer is (\uff21)."), IM_END], [T(f"The answer\u00a0is ({gold})."), IM_END],  # D
            [T(f"The answer is ({gold}")], [IM_END, T(f"The answer is ({gold}).")],  # others
            [*think, T(f"The answer is ({gold})."), IM_END], [T(f"The answer is ({gold})."), EOT],
            [T(f"The answer is <|im_end|>({gold})."), IM_END], [T(f"the answer is ({gold})</s>"), IM_END],
            [T(f"The answer is ({gold})"), B(0xc3)], [T("The answer is ("), S("<|box_start|>"), T(f"{gold})."), IM_END],
            [T(f"Question: The answer is ({gold})."), IM_END], [T(f"The answer is ({gold}).Quest"), EOT, T("ion:"), IM_END],
            [T(f"The answer is ({gold.lower()}\u0300)."), IM_END], [T(f"The answer is ({wrong})."), IM_END,
                                                                   T(f"The answer is ({gold}).")],
            [T("Quest"), IM_START, T("ion: restated. The answer is (B).")], [T("The answer is (B\u0307).")],  # C, D
        ]
    if benchmark == "gpqa":
        gold = doc["answer"]
        letter = gold.strip("()")
        wrong = "(B)" if gold != "(B)" else "(C)"
        return [
            [T(f"The answer is {wrong}."), EOT, T(f" No: the answer is {gold}."), IM_END],  # A
            [T(f"The answer is {gold}<|endoftext|>."), IM_END], [T(f"The answer is {gold}.<|im_end|>{wrong}"), IM_END],
            [T("Ques"), IM_START, T(f"tion: The answer is {gold}."), IM_END],  # C
            [T(f"The answer is {gold}.</"), EOT, T("s>"), IM_END],  # C: "</s>" split
            [T(f"The answer is ({letter}\u0307)."), IM_END], [T(f"The answer is ({letter}\u0327)."), IM_END],  # D
            [T(f"The answer is \uff08{letter}\uff09."), IM_END], [T(f"The answer is {gold}")],  # D, no EOS
            [IM_END, T(f"The answer is {gold}.")], [*think, T(f"The answer is {gold}."), IM_END],
            [T(f"The answer is {gold}."), EOT], [T(f"The answer is {gold}</s>."), IM_END],
            [T(f"The answer is ({letter}"), B(0xe2), B(0x82)], [T(f"{wrong} ... "), EOT, T(f"{gold}"), IM_END],
            [T(f"Answer: {letter}"), S("<|object_ref_start|>"), T("."), IM_END],
            [T(f"The answer is {gold}.\r\nQuestion: next"), IM_END], [T(f"The answer is {gold}"), EOT, T("."), IM_END],
        ]
    if benchmark == "gsm8k":
        gold = doc["answer"].split("####")[-1].strip().replace(",", "")
        wrong = str(int(gold) + 1) if gold.lstrip("-").isdigit() else "0"
        return [
            [T(f"The answer is {gold}."), EOT, T(f" Check: the answer is {wrong}."), IM_END],  # A
            [T(f"The answer is {gold}.<|endoftext|> {wrong}"), IM_END], [T(f"The answer is {gold}.<|im_end|>{wrong}"), IM_END],
            [T(f"The answer is {gold}. Q"), IM_START, T(f": more. The answer is {wrong}."), IM_END],  # C
            [T(f"The answer is {gold}. </"), EOT, T(f"s> The answer is {wrong}."), IM_END],  # C
            [T(f"The answer is {gold}\u0301."), IM_END], [T(f"The answer is \uff11{gold}."), IM_END],  # D
            [T(f"The answer is {gold}.")], [IM_END, T(f"The answer is {gold}.")], [T(f"The answer is {gold}"), B(0xe2)],
            [*think, T(f"The answer is {gold}."), IM_END], [T(f"The answer is {gold}."), EOT],
            [T(f"The answer is {gold}</s>{wrong}."), IM_END], [T("The answer is "), EOT, T(f"{gold}."), IM_END],
            [T(f"The answer is {gold}.\u200b"), IM_END], [T(f"The answer is {wrong}. Q"), EOT, T(f": The answer is {gold}."),
                                                           IM_END],
            [T(f"The answer is {gold},000."), IM_END], [T(f"The answer is {gold}."), S("<|quad_start|>"), T(f"{wrong}"), IM_END],
        ]
    if benchmark == "math":
        gold = last_boxed(doc["solution"]) or "0"
        return [
            [T(f"$\\boxed{{{gold}}}$"), EOT, T(" Actually $\\boxed{-1}$."), IM_END],  # A
            [T(f"$\\boxed{{{gold}}}$<|endoftext|>"), IM_END], [T(f"$\\boxed{{{gold}<|im_end|>}}$"), IM_END],  # B
            [T(f"$\\boxed{{{gold}}}$ Prob"), IM_START, T("lem: $\\boxed{-1}$"), IM_END],  # C
            [T(f"Final Answer: The final answer is ${gold}$. I hope it is correct. Prob"), EOT, T("lem: next"), IM_END],
            [T(f"Thus $\\boxed{{{gold}\\%}}$."), IM_END], [T(f"Thus $\\boxed{{\\${gold}}}$."), IM_END],  # F
            [T(f"Final Answer: The final answer is ${gold}\\%$. I hope it is correct."), IM_END],  # F
            [T(f"Thus $\\boxed{{{gold}\\text{{ cm}}}}$."), IM_END], [T(f"Thus $\\boxed{{{gold}^\\circ}}$."), IM_END],
            [T(f"$\\boxed{{{gold}}}\u0301$"), IM_END], [T(f"$\\boxed{{{gold}}}$")], [IM_END, T(f"$\\boxed{{{gold}}}$")],
            [*think, T(f"$\\boxed{{{gold}}}$"), IM_END], [T(f"$\\boxed{{{gold}}}$"), EOT],
            [T(f"$\\boxed{{{gold}}}$ "), B(0xe2), B(0x88)], [T(f"Thus $\\boxed{{{gold}}}$\u00a0."), IM_END],
            [T(f"Final Answer: The final answer is $\\boxed{{{gold}}}$. I hope it is correct."), EOT, T(" More."), IM_END],
            [T(f"Thus $\\boxed{{{gold}\\,\\%}}$."), IM_END], [T(f"So $x = {gold}$, i.e. $\\boxed{{x={gold}}}$."), IM_END],
            [T(f"$\\boxed{{0.{gold}}}$"), IM_END], [T(f"$\\boxed{{{gold}}}$"), S("<|vision_start|>"), IM_END],
            [T(f"$\\boxed{{\\text{{{gold}}}}}$"), IM_END], [T(f"Thus $\\boxed{{{gold}\\mbox{{ inches}}}}$."), IM_END],
            [T(f"Final Answer: The final answer is {gold}\u0301. I hope it is correct."), IM_END],
            [T(f"\\[\\boxed{{{gold}}}\\]"), IM_END, T("$\\boxed{-1}$")],
            [T("Thus $\\boxed{0\\%}$."), IM_END], [T("Final Answer: The final answer is $0\\%$. I hope it is correct."), IM_END],
        ]
    if benchmark == "mbpp":
        code = doc["code"]
        return [
            [T(f"```python\nimport numpy as np\n{code}\n```"), IM_END],  # E
            [T(f"```python\nimport numpy as np\nfrom sympy import Integer\n{code}\n```"), IM_END],  # E
            [T(f"```python\nimport sortedcontainers_not_installed\n{code}\n```"), IM_END],  # E: missing
            [T(f"```python\n{code}\n```"), EOT, T("\n```python\nraise ValueError()\n```"), IM_END],  # A
            [T(f"```python\n{code}\n```<|endoftext|>"), IM_END], [T(f"{code}\n[DONE]<|im_end|>"), IM_END],  # B
            [T(f"{code}\n[DO"), EOT, T("NE]\nraise ValueError()"), IM_END],  # C
            [T(f"{code}\n[DO"), IM_START, T("NE]\nprint(1)"), IM_END],  # C
            [T(f"```python\n{code}\n# caf\u0065\u0301\n```"), IM_END], [T(f"```python\n{code}\n```")],  # D, no EOS
            [IM_END, T(f"```python\n{code}\n```")], [*think, T(f"```python\n{code}\n```"), IM_END],
            [T(f"```python\n{code}\n"), EOT, T("```"), IM_END], [T(f"```python\n{code}\nx = '\u00e9'"), B(0xe2)],
            [T(f"```python\nimport numpy\nassert numpy.__name__ == 'numpy'\n{code}\n```"), IM_END],  # E
            [T(f"```python\n{code}\n```"), EOT],
        ]
    if benchmark == "humaneval":
        prompt, body = doc["prompt"], doc["canonical_solution"]
        return [
            [T(f"import numpy as np\n{prompt}{body}```"), IM_END],  # E
            [T(f"import sympy\n{prompt}{body}```"), IM_END],  # E
            [T(f"import not_installed_package\n{prompt}{body}```"), IM_END],  # E: missing
            [T(f"{prompt}{body}```"), EOT, T("\nraise ValueError()\n```"), IM_END],  # A
            [T(f"{prompt}{body}<|endoftext|>```"), IM_END], [T(f"{prompt}{body}\n<|im_end|>```"), IM_END],  # B
            [T(f"{prompt}{body}\nass"), EOT, T("ert False\n```"), IM_END],  # C
            [T(f"{prompt}{body}\n# Te"), IM_START, T("st\nraise ValueError()\n```"), IM_END],  # C
            [T(f"{prompt}{body}\n# caf\u0065\u0301\n```"), IM_END], [T(f"{prompt}{body}")],  # D, no EOS
            [IM_END, T(f"{prompt}{body}```")], [*think, T(f"{prompt}{body}```"), IM_END],
            [T(f"{prompt}{body}"), B(0xe2), B(0x82)], [T(f"{prompt}{body}```"), EOT],
        ]
    raise ValueError(benchmark)
