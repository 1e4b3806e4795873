"""The version of sglang-fleet-ops is the collection's, read from galaxy.yml when the package is
built from the repository (ops/ beside galaxy.yml), else from the sdist's PKG-INFO: one ref of the
repository gives the collection and the CLI one version, which the CLI checks at start."""

import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent


def version() -> str:
    galaxy = HERE.parent / "galaxy.yml"
    if galaxy.is_file():
        found = re.search(r"^version:\s*['\"]?([^'\"\s#]+)", galaxy.read_text(encoding="utf-8"), re.MULTILINE)
        if found:
            return found.group(1)
    pkg_info = HERE / "PKG-INFO"
    if pkg_info.is_file():
        found = re.search(r"^Version:\s*(\S+)", pkg_info.read_text(encoding="utf-8"), re.MULTILINE)
        if found:
            return found.group(1)
    raise SystemExit(f"no version: neither {galaxy} nor {pkg_info} names one")


setup(version=version())
