"""CPU-only simulator of a GPU host running SGLang, for sglang-fleet's tests."""

__version__ = "0.1.0"
