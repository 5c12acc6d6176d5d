"""Prompts through the tokenizer's chat template, as token ids (the form every decoder takes)."""

from __future__ import annotations

from typing import Any

from refusion_cli.errors import UserError

NO_TEMPLATE_HINT = "use a chat (instruct) checkpoint, or give its tokenizer a chat_template (chat_template.jinja)"


def require_chat_template(tokenizer: Any, name: str | None = None,
                          use: str = "prompts are rendered as chat turns") -> None:
    """Refuse a tokenizer without a chat template: every prompt here (and every training record) is a chat turn."""
    if not getattr(tokenizer, "chat_template", None):
        whose = f"the tokenizer of {name}" if name else "the tokenizer"
        raise UserError(f"{whose} has no chat template; {use}", hint=NO_TEMPLATE_HINT)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]], **template_options: Any) -> list[int]:
    """Render ``messages`` with the chat template plus the generation prompt, then tokenize the text.

    ``template_options`` reach the template (e.g. ``enable_thinking=False`` for Qwen3's).
    """
    require_chat_template(tokenizer)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_options)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def user_prompt_ids(tokenizer: Any, question: str, **template_options: Any) -> list[int]:
    """A single user turn, ready for the assistant's answer."""
    return chat_prompt_ids(tokenizer, [{"role": "user", "content": question}], **template_options)
