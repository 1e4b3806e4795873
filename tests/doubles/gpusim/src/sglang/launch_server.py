"""Launch the inference server."""

import sys
import warnings


def _run() -> int:
    from gpusim import launcher  # noqa: PLC0415
    from gpusim.config import Config, ConfigError  # noqa: PLC0415

    try:
        cfg = Config.load()
    except ConfigError as exc:
        sys.stderr.write(f"gpusim: configuration error: {exc}\n")
        return 1
    if cfg.version.entrypoint_warning:
        warnings.warn(
            "'python -m sglang.launch_server' is still supported, but "
            "'sglang serve' is the recommended entrypoint.\n"
            "  Example: sglang serve --model-path <model> [options]",
            UserWarning,
            stacklevel=1,
        )
    return launcher.main(sys.argv[1:], cfg)


if __name__ == "__main__":
    sys.exit(_run())
