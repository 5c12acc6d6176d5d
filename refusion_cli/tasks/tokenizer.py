"""Train the small byte-level BPE tokenizer of the embedded tiny models.

Contract of ``train_tokenizer(texts, vocab_size, out_dir)``:

- Byte-level BPE (``tokenizers``): every string round-trips, ``decode(encode(x)) == x``. All 256
  byte symbols are in the vocabulary whatever the corpus holds.
- Pre-tokenization splits every digit on its own (``Digits(individual_digits=True)``) before the
  GPT-2 style byte-level split, so a number is always a sequence of one-digit tokens.
- The special tokens are Qwen3's ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos)
  and ReFusion's ``<|mask|>`` (mask), each a single id, never split or merged. Their ids are
  whatever the trainer assigns; read them from the tokenizer, never hard-code them.
- The chat template is Qwen3's without the thinking block: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``
  per message and ``<|im_start|>assistant\\n`` when ``add_generation_prompt=True``. Extra template
  variables (``enable_thinking=False``, ``tools=None``, ...) are accepted and ignored.
- The result is a transformers ``PreTrainedTokenizerFast`` saved with ``save_pretrained`` to
  ``out_dir``; ``AutoTokenizer.from_pretrained(out_dir)`` loads it offline. Training is
  deterministic: the same texts and vocab size give the same files.

The command line is ``python -m tools.tokenizer`` (from the repository root). On the synthetic
corpus the merges run out at about 460 tokens: any vocabulary size above that gives the same
tokenizer, so read the size from ``len(tokenizer)``, never from the argument.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN, MASK_TOKEN)
DEFAULT_VOCAB_SIZE = 512
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())  # every byte has a token

# Qwen3's template reduced to its message framing: no system-prompt default, no tools, no <think>.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def build_backend(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """The raw ``tokenizers`` BPE model trained on ``texts``."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (special tokens + 256 bytes), got {vocab_size}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return backend


def wrap(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """A transformers tokenizer around ``backend`` with Qwen3's special tokens and chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # decode must give back the exact text
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Train on ``texts``, save to ``out_dir`` with ``save_pretrained`` and return the tokenizer."""
    tokenizer = wrap(build_backend(texts, vocab_size))
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def corpus_texts(rows: Iterable[dict[str, str]]) -> Iterable[str]:
    """The training texts of a synthetic split (``question`` / ``answer`` rows); see :func:`chat_texts`."""
    return chat_texts((row["question"], row["answer"]) for row in rows)


def chat_texts(pairs: Iterable[tuple[str, str]]) -> Iterable[str]:
    """Each (prompt, response) as the chat template lays its turns out between its special tokens
    ("user\\n<prompt>", "assistant\\n<response>"), so the role names get merged too. The special
    tokens themselves stay out: the trainer would learn merges of their bytes."""
    for prompt, response in pairs:
        yield f"user\n{prompt}"
        yield f"assistant\n{response}"
