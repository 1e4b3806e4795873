"""Resumable, crash-consistent generation client for fleets of SGLang servers."""

__version__ = "0.1.0"
