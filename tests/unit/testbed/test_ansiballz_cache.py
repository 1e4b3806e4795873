"""The test controller's cache of the imports Ansible finds in module_utils sources
(tests/testbed/ansiballz_cache): Ansible's own import finder reads the same imports, with the same
standing (required or optional), from the cached text as from the whole source, for every
module_utils file of ansible-core and of the collection."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import ansible.module_utils
import pytest
from ansible.executor import module_common

REPO = Path(__file__).resolve().parents[3]
HOOK = REPO / "tests" / "testbed" / "ansiballz_cache" / "sglang_fleet_testbed_imports.py"
SOURCES = sorted(Path(ansible.module_utils.__file__).parent.rglob("*.py")) + sorted(
    (REPO / "plugins" / "module_utils").rglob("*.py")
)


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sglang_fleet_testbed_imports_under_test", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _found(name: str, tree: ast.Module) -> tuple[set, set, object]:
    finder = module_common.ModuleDepFinder(name, tree, name.endswith("__init__"))
    return set(finder.submodules), set(finder.optional_imports), module_common._get_module_metadata(tree)


def test_the_finder_reads_the_same_imports_from_the_cached_text() -> None:
    hook = _hook()
    checked = 0
    for path in SOURCES:
        source = path.read_bytes()
        name = "ansible.module_utils." + path.stem if "ansible" in path.parts else "x." + path.stem
        full = compile(source, str(path), "exec", ast.PyCF_ONLY_AST)
        short = ast.parse(hook.imports_only(full))
        assert _found(name, short) == _found(name, full), path
        checked += 1
    assert checked > 100


def test_an_import_under_a_condition_stays_optional() -> None:
    source = (
        "from __future__ import annotations\n"
        "import ansible.module_utils.basic\n"
        "METADATA = 'x'\n"
        "try:\n    from ansible.module_utils.six import PY3\nexcept ImportError:\n    pass\n"
        "def f():\n    import ansible.module_utils.common.text.converters as c\n"
    )
    hook = _hook()
    text = hook.imports_only(ast.parse(source))
    assert text.splitlines()[:3] == [
        "from __future__ import annotations",
        "import ansible.module_utils.basic",
        "METADATA = 'x'",
    ]
    required, optional = _found("m", ast.parse(text))[:2]
    assert optional == {
        ("ansible", "module_utils", "six", "PY3"),
        ("ansible", "module_utils", "common", "text", "converters"),
    }
    assert required - optional == {("ansible", "module_utils", "basic")}


def test_ansible_core_builds_its_payloads_through_the_cache(tmp_path: Path) -> None:
    """In a fresh interpreter the hook patches ansible-core's compile step when it is imported,
    the second build of a module reads the cache, and a source that does not compile fails as
    ansible-core fails it."""
    code = f"""
import sys
sys.path.insert(0, {str(HOOK.parent)!r})
import sglang_fleet_testbed_imports as hook
hook.CACHE = {str(tmp_path / "cache")!r}
from ansible.executor import module_common as m
assert m._compile_module_ast.__qualname__.startswith("cached."), m._compile_module_ast
src = b"import ansible.module_utils.basic\\n"
first = m._compile_module_ast("a", src)
assert len(first.body) == 1
import os
assert len(os.listdir(hook.CACHE)) == 1
second = m._compile_module_ast("a", src)
assert [type(n).__name__ for n in second.body] == ["Import"]
try:
    m._compile_module_ast("bad", b"def (:\\n")
except Exception as exc:
    print(type(exc).__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "AnsibleError"


@pytest.mark.parametrize("name", ["json", "ansible"])
def test_nothing_is_patched_until_the_target_is_imported(name: str) -> None:
    code = f"""
import sys
sys.path.insert(0, {str(HOOK.parent)!r})
import sglang_fleet_testbed_imports
import {name}
print("ansible.executor.module_common" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
