from sglang import __version__

__all__ = ["__version__"]
