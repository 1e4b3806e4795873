"""The test hosts' cache of the code of modules imported from zip archives (Ansible's AnsiballZ
payloads), kept between module runs and keyed by each file's source.

zipimport compiles an archive's .py files at every import, and Ansible sends its module_utils as
source: every module run on a test host spent about 0.3 CPU-seconds compiling
ansible.module_utils.basic and what it imports, the largest share of a module's cost on the
2-core test machines. With this cache it loads the code compiled by an earlier run. Nothing else
changes: each code object is ``compile()`` of the same source, its file names set to this run's
path in the archive. tools/testhost/build-image.sh installs it into the test-host image's
system Python (a .pth file imports it), which runs the modules, and `make venv` into the
controller's virtualenv, which runs the tests' localhost tasks (20 local module runs: 16.7 ->
11.8 CPU-seconds); nothing of the collection installs or needs it.
"""

from __future__ import annotations

# Only what every Python start already has (the .pth imports this module in every process); the
# rest is imported at the first module imported from an archive.
import os
import zipimport

TYPE_CHECKING = False  # typing's, without importing typing at every start
if TYPE_CHECKING:
    import types

CACHE = "/var/cache/sglang-fleet-testbed/pyc"
_compile_source = zipimport._compile_source  # type: ignore[attr-defined]


def _refile(code: types.CodeType, name: str) -> types.CodeType:
    """``code`` and the code objects it holds, their file name ``name``."""
    import types  # noqa: PLC0415

    consts = tuple(_refile(c, name) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=name, co_consts=consts)


def cached_compile(pathname: str, source: bytes) -> types.CodeType:
    """zipimport's ``_compile_source``, through the cache."""
    import hashlib  # noqa: PLC0415
    import importlib.util  # noqa: PLC0415
    import marshal  # noqa: PLC0415
    import types  # noqa: PLC0415

    tag = importlib.util.MAGIC_NUMBER.hex()
    path = os.path.join(CACHE, f"{tag}-{hashlib.sha256(source).hexdigest()}")
    try:
        with open(path, "rb") as f:
            code = marshal.load(f)  # noqa: S302 (root's own cache, in a directory only root writes)
        if isinstance(code, types.CodeType):
            return _refile(code, pathname)
    except (OSError, ValueError, EOFError, TypeError):
        pass
    code = _compile_source(pathname, source)
    try:
        os.makedirs(CACHE, mode=0o755, exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "wb") as f:
            marshal.dump(code, f)
        os.replace(tmp, path)
    except OSError:
        pass  # not writable (a module run as another user): compiled as without the cache
    return code


zipimport._compile_source = cached_compile  # type: ignore[attr-defined]
