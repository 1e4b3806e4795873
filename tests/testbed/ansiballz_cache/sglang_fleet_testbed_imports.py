"""The test controller's cache of the imports Ansible finds in each module_utils source.

Every ansible-playbook run builds the payload of each module it uses (AnsiballZ) once: to find
the module_utils a module needs, ansible-core compiles the module and every module_utils file it
reaches to a syntax tree and walks the whole tree for import statements
(``ansible.executor.module_common.recursive_finder``), about 50 files of ansible-core's own per
module. On the 2-core test machines that was the largest single share of the controller's CPU in
the test runs (a tenth of the samples of a pod scenario), repeated by every run of every
scenario.

This cache keeps, per source (keyed by its sha256), the statements the finder reads: the
top-level imports and ``METADATA`` assignment as they are, and every nested import under one
``if`` (the finder tells a top-level import, required, from any other, optional, and nothing
else). A later build compiles that short text instead of the whole file, and the finder sees the
same imports with the same standing. A source that does not compile is handed to ansible-core as
it is, so its error is ansible-core's own.

``make venv`` installs it into the controller's virtualenv with a .pth file; it patches
``ansible.executor.module_common._compile_module_ast`` when that module is first imported (not
before: most Python processes never import it). Nothing of the collection installs or needs it.
"""

from __future__ import annotations

# Only what every Python start already has: the .pth imports this module in every process of the
# virtualenv, and the rest is needed only once Ansible builds a payload.
import os
import sys

TYPE_CHECKING = False  # typing's, without importing typing at every start
if TYPE_CHECKING:
    import ast
    from collections.abc import Callable
    from typing import Any

CACHE = "/var/cache/sglang-fleet-testbed/imports"
TARGET = "ansible.executor.module_common"
_VERSION = "1"  # the format of a cached text; part of each key


def imports_only(tree: ast.Module) -> str:
    """The statements of ``tree`` that Ansible's import finder reads, as source text."""
    import ast  # noqa: PLC0415

    top = [
        node
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        or (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "METADATA"
        )
    ]
    seen = {id(node) for node in top}
    nested = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in seen]
    lines = [ast.unparse(node) for node in top]
    if nested:
        lines.append("if True:")
        lines += ["    " + ast.unparse(node) for node in nested]
    return "\n".join(lines) + "\n"


def cached(original: Callable[[str, str | bytes], ast.Module]) -> Callable[[str, str | bytes], ast.Module]:
    """``original`` (``_compile_module_ast``) through the cache."""
    import ast  # noqa: PLC0415
    import hashlib  # noqa: PLC0415

    def compile_module_ast(module_name: str, source_code: str | bytes) -> ast.Module:
        data = source_code.encode() if isinstance(source_code, str) else bytes(source_code)
        key = hashlib.sha256(_VERSION.encode() + data).hexdigest()
        path = os.path.join(CACHE, key)
        try:
            with open(path, encoding="utf-8") as f:
                return ast.parse(f.read(), filename=module_name)
        except (OSError, SyntaxError, ValueError):
            pass
        tree = original(module_name, source_code)
        try:
            os.makedirs(CACHE, mode=0o755, exist_ok=True)
            tmp = f"{path}.{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(imports_only(tree))
            os.replace(tmp, path)
        except OSError:
            pass  # not writable: built as without the cache
        return tree

    return compile_module_ast


class _Patcher:
    """A meta path finder that patches the target module right after it is first executed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TARGET:
            return None
        import importlib.util  # noqa: PLC0415

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            original = getattr(module, "_compile_module_ast", None)
            if callable(original):
                module._compile_module_ast = cached(original)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    if TARGET not in sys.modules and not any(isinstance(f, _Patcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _Patcher())


install()
