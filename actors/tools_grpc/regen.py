"""Regenerate the committed protobuf modules: ``python -m actors.tools_grpc.regen``.

The generated ``*_pb2.py`` / ``*_pb2_grpc.py`` / ``*_pb2.pyi`` files are committed because they are
imported at runtime; this script (not make) rebuilds them from the ``.proto`` sources with the
``grpcio-tools`` compiler pinned in the dev extras. Paths are repo-relative, so the generated
imports read ``from actors.tools_grpc import tether_tools_pb2``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PROTOS", "REPO_ROOT", "compile_protos"]

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTOS: tuple[str, ...] = (
    "actors/tools_grpc/tether_tools.proto",
    "testbed/tools/testbed_tools.proto",
)


def compile_protos(protos: Sequence[str] = PROTOS, root: Path = REPO_ROOT) -> None:
    """Compile each repo-relative ``.proto`` in ``protos`` next to itself; raise on compiler errors."""
    from grpc_tools import protoc  # dev-only dependency, imported on use

    for proto in protos:
        if not (root / proto).is_file():
            raise FileNotFoundError(f"{proto}: no such proto under {root}")
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
            proto,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"{proto}: protoc failed (see the compiler output above)")
        for suffix in ("_pb2_grpc.py", "_pb2.pyi"):
            _mark_untyped(root / proto.replace(".proto", suffix))


def _mark_untyped(generated: Path) -> None:
    # The gRPC stubs carry no annotations (no .pyi is generated for them) and the message stubs use
    # bare generics; tell mypy not to report inside generated code. Callers bind the stub classes to
    # typed names instead.
    text = generated.read_text()
    if not text.startswith(_MYPY_HEADER):
        generated.write_text(_MYPY_HEADER + text)


_MYPY_HEADER = "# mypy: ignore-errors\n"


if __name__ == "__main__":
    compile_protos(sys.argv[1:] or PROTOS)
