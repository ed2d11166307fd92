"""ARCHITECTURE.md, "Dependencies point one way": runtime <- scheduler, breakers <- actors <- cluster.

Read from the source (the AST of every module), not from what happens to be imported at test time: an
import inside a function counts as much as one at the top, and so does ``importlib.import_module("x")``
with a literal name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# Libraries that put a process on the network or on a cluster: runtime/ is pure logic (its ports are
# implemented by actors/ and cluster/).
NETWORK_LIBS = frozenset(
    {
        "aiohttp",
        "grpc",
        "http",
        "httpx",
        "openai",
        "prometheus_client",
        "ray",
        "redis",
        "requests",
        "socket",
        "ssl",
        "urllib",
        "urllib3",
        "websockets",
    }
)


def python_files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(source: str, filename: str) -> Iterator[tuple[int, str]]:
    """(line, module name) of every import in ``source``, including literal dynamic imports."""
    tree = ast.parse(source, filename=filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module is not None:
                yield node.lineno, node.module
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    yield node.lineno, first.value


def offending(packages: tuple[str, ...], forbidden: frozenset[str]) -> list[str]:
    found = []
    for package in packages:
        for path in python_files(package):
            for line, module in imported_modules(path.read_text(), str(path)):
                if module.split(".")[0] in forbidden:
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return found


def test_the_import_scanner_sees_every_kind_of_import() -> None:
    # Given a module that reaches cluster/ in four different ways
    source = (
        "import cluster.control\n"
        "from cluster import signing\n"
        "def late():\n"
        "    from cluster.log_store import RedisLogStore\n"
        "    import importlib\n"
        "    importlib.import_module('cluster.adapters')\n"
        "from . import sibling\n"
    )
    # When it is scanned
    found = [m for _, m in imported_modules(source, "<test>")]
    # Then all four are reported (and the relative import is not mistaken for a top-level package)
    assert found == ["cluster.control", "cluster", "cluster.log_store", "importlib", "cluster.adapters"]


@pytest.mark.parametrize("package", ["actors", "scheduler", "breakers", "runtime"])
def test_no_layer_below_cluster_imports_cluster(package: str) -> None:
    # Given the package's sources (it exists and is not empty)
    assert python_files(package), f"no python files under {package}/"
    # Then none of them imports cluster/, statically or by a literal dynamic import
    assert offending((package,), frozenset({"cluster"})) == []


@pytest.mark.parametrize("package", ["scheduler", "breakers", "runtime"])
def test_no_layer_below_actors_imports_actors(package: str) -> None:
    assert offending((package,), frozenset({"actors"})) == []


def test_runtime_imports_no_cluster_network_or_service_library() -> None:
    assert offending(("runtime",), NETWORK_LIBS) == []
