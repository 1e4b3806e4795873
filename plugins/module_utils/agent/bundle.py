# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The agent package as one Python source, built from the package's own files.

Two places need the whole agent without installing a package: a Proxmox LXC container, where
``pct exec CTID -- python3 -c PAYLOAD`` runs it with the request on stdin (:func:`command_payload`),
and the units' start guard, which imports it from the one file the server role installs beside it
(:func:`bundle_source`, installed as ``sglang_fleet_agent.py``).

The bundle holds each module's source and a small importer: run as a script it registers the
package under :data:`PACKAGE` and runs ``ops.main``; imported under that name it makes itself the
package, so ``from sglang_fleet_agent import procfs`` works. The modules import each other
relatively, so they work under either name.
"""

from __future__ import annotations

import base64
import importlib
import pkgutil
import zlib

PACKAGE = "sglang_fleet_agent"

_IMPORTER = '''
import sys as _sys
import types as _types
from importlib.abc import Loader as _Loader, MetaPathFinder as _MetaPathFinder
from importlib.machinery import ModuleSpec as _ModuleSpec


class _BundleImporter(_MetaPathFinder, _Loader):
    """Serves the package's modules from _SOURCES."""

    def __init__(self, package, sources):
        self.package = package
        self.sources = sources

    def _module(self, fullname):
        head, _, name = fullname.rpartition(".")
        return name if head == self.package and name in self.sources else None

    def find_spec(self, fullname, path=None, target=None):
        name = self._module(fullname)
        if name is None:
            return None
        return _ModuleSpec(fullname, self, origin=self.package + "/" + name + ".py")

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        name = self._module(module.__name__)
        exec(compile(self.sources[name], module.__spec__.origin, "exec"), module.__dict__)

    def get_source(self, fullname):
        return self.sources.get(self._module(fullname) or "")


if __name__ == _PACKAGE:  # imported as the installed file: this module is the package
    _package = _sys.modules[_PACKAGE]
    if __spec__ is not None:
        __spec__.submodule_search_locations = []
else:  # run as a script (python3 -c): the package is a module of its own
    _package = _types.ModuleType(_PACKAGE)
    _sys.modules[_PACKAGE] = _package
_package.__path__ = []
_package.__package__ = _PACKAGE
_sys.meta_path.insert(0, _BundleImporter(_PACKAGE, _SOURCES))
exec(compile(_SOURCES["__init__"], _PACKAGE + "/__init__.py", "exec"), _package.__dict__)
if __name__ == "__main__":
    __import__(_PACKAGE + ".ops", fromlist=["main"]).main()
'''


def package_sources() -> dict[str, str]:
    """Every module of the agent package by name, read through its loader (so also from the zip
    an Ansible module runs from)."""
    package = importlib.import_module(__package__)
    # This module only builds the bundle: the bundle does not need it.
    modules = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.ispkg and m.name != "bundle")
    names = ["__init__", *modules]
    sources = {}
    for name in names:
        data = pkgutil.get_data(__package__, f"{name}.py")
        if data is None:  # pragma: no cover - only if the collection is packaged without sources
            raise RuntimeError(f"cannot read the host agent's module {name}")
        sources[name] = data.decode("utf-8")
    return sources


def bundle_source() -> str:
    """The agent as one readable Python file (what the start guard imports)."""
    return (
        "# The sglang-fleet host agent (plugins/module_utils/agent), every module in one file:\n"
        "# built by plugins/module_utils/agent/bundle.py. Standard library only, Python 3.9+.\n"
        f"_PACKAGE = {PACKAGE!r}\n"
        "_SOURCES = {\n"
        + "".join(f"    {name!r}: {source!r},\n" for name, source in package_sources().items())
        + "}\n"
        + _IMPORTER
    )


def command_payload() -> str:
    """The agent as a ``python3 -c`` argument: the bundle compressed, because one argument of a
    command line may not exceed 128 KiB (MAX_ARG_STRLEN) and the bundle is close to it."""
    packed = base64.b64encode(zlib.compress(bundle_source().encode("utf-8"), 9)).decode("ascii")
    return (
        "import base64, zlib\n"
        f"exec(compile(zlib.decompress(base64.b64decode({packed!r})), {PACKAGE + '.py'!r}, 'exec'))\n"
    )
