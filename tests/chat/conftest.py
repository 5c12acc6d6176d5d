import shutil

import pytest

# A chat template in the manner of those that take no system message (Gemma's, older Mistral's): it
# raises on one. Otherwise the synthetic task's template (refusion_cli/tasks/tokenizer.py).
NO_SYSTEM_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="session")
def no_system_checkpoint(causal_checkpoint, tmp_path_factory):
    """The tiny causal checkpoint with a chat template that raises on a system message."""
    directory = shutil.copytree(causal_checkpoint, tmp_path_factory.mktemp("no-system") / "ckpt")
    (directory / "chat_template.jinja").write_text(NO_SYSTEM_TEMPLATE, encoding="utf-8")
    return directory
