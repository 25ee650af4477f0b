"""andrea: a training engine for the ANDREA family of GPT-style language models."""

__version__ = "0.1.0"
