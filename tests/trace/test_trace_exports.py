"""The trace package's lazily loaded names: what mypy is told (its TYPE_CHECKING imports) is what runs."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import hops_calib.trace as trace


def _type_checking_imports() -> dict[str, str]:
    """name -> module of each import under `if TYPE_CHECKING:` in hops_calib/trace/__init__.py."""
    tree = ast.parse(Path(trace.__file__).read_text(encoding="utf-8"))
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom) and statement.module, ast.dump(statement)
                found.update({alias.name: statement.module for alias in statement.names})
    return found


def test_type_checking_imports_are_the_lazy_names() -> None:
    declared = _type_checking_imports()
    lazy = {name: f"hops_calib.trace.{module}" for name, module in trace._MODULE_OF.items()}
    assert declared == lazy, {"only_type_checked": sorted(set(declared) - set(lazy)),
                              "only_lazy": sorted(set(lazy) - set(declared)),
                              "other_module": sorted(n for n in set(declared) & set(lazy) if declared[n] != lazy[n])}
    assert sorted(trace.__all__) == sorted(lazy)


def test_each_lazy_name_loads_the_object_of_its_module() -> None:
    for name, module in trace._MODULE_OF.items():
        assert getattr(trace, name) is getattr(importlib.import_module(f"hops_calib.trace.{module}"), name)
