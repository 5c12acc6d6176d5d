import pytest


@pytest.fixture(scope="session")
def qwen3():
    """The byte-level stand-in for Qwen3's tokenizer (``tools.paper_parity.byte_level_tokenizer``): the
    parity checks' tokenizer, built in milliseconds."""
    from tools.paper_parity import byte_level_tokenizer

    return byte_level_tokenizer()
