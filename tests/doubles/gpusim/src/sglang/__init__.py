"""Stand-in for the ``sglang`` package: ``python -m sglang.launch_server`` runs gpusim.

``__version__`` is the SGLang version the simulator is configured to mimic.
"""


def _configured_version() -> str:
    try:
        from gpusim.config import Config  # noqa: PLC0415

        return str(Config.load().version)
    except Exception:
        return "0.5.23"


__version__ = _configured_version()
