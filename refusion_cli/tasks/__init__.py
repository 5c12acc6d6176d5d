"""Tasks the embedded tiny models are trained and evaluated on, and the tokenizer built for them.

``synthetic``: the seeded GSM8K-format word-problem generator, its splits and answer checking.
``tokenizer``: the byte-level BPE tokenizer trained on that corpus, with Qwen3's special tokens.
"""
