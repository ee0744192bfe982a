"""The public surface: every module says what it exports, and the package exports what the docs say."""

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import tierkv

ROOT = Path(__file__).resolve().parent.parent
# the README and the Python library's page: where the public names and the import examples are
README = (ROOT / "README.md").read_text() + (ROOT / "docs" / "python.md").read_text()
OPTIONAL = ("tierkv.integrations",)  # need packages the main venv does not have (vLLM)


def _modules() -> list[str]:
    names = ["tierkv"]
    for info in pkgutil.walk_packages(tierkv.__path__, "tierkv."):
        if not info.name.startswith(OPTIONAL) and info.name != "tierkv._cuda_ext":
            names.append(info.name)
    return names


@pytest.mark.parametrize("name", _modules())
def test_every_module_declares_all_and_each_name_exists(name: str) -> None:
    module = importlib.import_module(name)
    if name.endswith("__main__"):
        return
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"


def test_the_package_exports_what_the_readme_lists() -> None:
    listed = re.search(r"<!-- public-api -->(.*?)<!-- /public-api -->", README, re.S)
    assert listed is not None
    assert sorted(re.findall(r"`(\w+)`", listed.group(1))) == sorted(tierkv.__all__)


def test_every_tierkv_import_in_the_readme_is_public() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    imports = [
        (node.module, alias.name)
        for block in blocks
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tierkv")
        for alias in node.names
    ]
    assert imports
    for module, name in imports:
        assert name in importlib.import_module(module).__all__, f"README imports {name} from {module}"
