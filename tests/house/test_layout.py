"""The package's layout, read from its code: rooms import one way (no cycle), modules too (no cycle between any
two), nothing imports the command layer but the entry point, only the command layer prints (progress bars and
warnings go through hops_calib.progress, on stderr), only the command layer lays text out in columns (its render
package turns the rooms' data into text), and the simulator core loads no trace reader. Imports inside
functions (lazy ones) count as much as those at the top."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hops_calib"
TESTS = Path(__file__).resolve().parents[1]
# Test folders that are no room of the package: the repository's pages (README, AGENTS.md, docs/) and its layout.
BESIDE_THE_ROOMS = ("docs", "house")
COMMAND_LAYER = "cli"
ENTRY_POINT = "__main__"
STDERR_HELPER = Path("progress.py")  # progress bars and warnings, on stderr
OUTPUT_MODULES = ("typer", "rich")
RENDER = Path("cli") / "render"  # the command layer's text for people
# A format spec that pads a value to a width ("{x:>10}", "{x:9.2f}", "{name:<17}"): a column of a text table. A
# zero-filled width ("{n:03d}", "{byte:02x}") numbers or encodes, and lays out nothing.
COLUMN_SPEC = re.compile(r"^(?:.?[<>^=])?[+\- ]?#?(?!0)\d+")


def room_of(module: str, package: str) -> str | None:
    """hops_calib.loop.gate -> loop; hops_calib.spec -> spec; hops_calib itself or another package -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == package else None


def imports_of(path: Path, root: Path) -> list[tuple[str, list[str], int]]:
    """Every import of a file (absolute and relative, at any depth of the code): (module, the names imported from it,
    none for `import m`, line)."""
    rel = path.relative_to(root.parent).with_suffix("")
    found: list[tuple[str, list[str], int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(rel.parts[:len(rel.parts) - node.level])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((module, [alias.name for alias in node.names], node.lineno))
    return found


def imported_modules(path: Path, root: Path) -> list[tuple[str, int]]:
    """Every module a file imports (absolute and relative, at any depth of the code), with its line."""
    found = []
    for module, names, line in imports_of(path, root):
        found.append((module, line))
        # `from hops_calib import ledger` imports the module hops_calib.ledger
        if module == root.name:
            found += [(f"{module}.{name}", line) for name in names]
    return found


def room_graph(root: Path) -> dict[str, dict[str, tuple[Path, int]]]:
    """room -> {room it imports: (first file, line)}; a top-level module is a room of its own."""
    graph: dict[str, dict[str, tuple[Path, int]]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts == ("__init__",):
            continue
        source = parts[0]
        edges = graph.setdefault(source, {})
        for module, line in imported_modules(path, root):
            target = room_of(module, root.name)
            if target is not None and target not in (source, "__init__"):
                edges.setdefault(target, (path, line))
    return graph


def module_name(path: Path, root: Path) -> str:
    """hops_calib/loop/gate.py -> hops_calib.loop.gate; hops_calib/store/__init__.py -> hops_calib.store."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(root: Path) -> dict[str, dict[str, tuple[Path, int]]]:
    """module -> {module of the package it imports: (file, line)}, imports at any depth of the code. `from a.b import
    c` imports the module a.b.c when there is one, else a.b; an import names the module itself, not the packages
    above it (their __init__ runs too, but holds only the room's names)."""
    paths = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, tuple[Path, int]]] = {}
    for source, path in paths.items():
        edges = graph.setdefault(source, {})
        for module, names, line in imports_of(path, root):
            if module.split(".")[0] != root.name:
                continue
            for target in {known(f"{module}.{name}" if f"{module}.{name}" in paths else module)
                           for name in names or [""]}:
                if target is not None and target != source:
                    edges.setdefault(target, (path, line))
    return graph


def cycles(graph: dict[str, dict[str, object]]) -> list[list[str]]:
    """The strongly connected components of more than one node (room or module) (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(room: str) -> None:
        index[room] = low[room] = len(index)
        stack.append(room)
        for other in graph.get(room, {}):
            if other not in index:
                visit(other)
                low[room] = min(low[room], low[other])
            elif other in stack:
                low[room] = min(low[room], index[other])
        if low[room] == index[room]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == room:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for room in sorted(graph):
        if room not in index:
            visit(room)
    return found


def output_calls(path: Path) -> list[str]:
    """Where a file prints: print(...), typer/rich output, writes to sys.stdout/sys.stderr, imports of typer/rich."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "print":
                found.append(f"{where}: print(...)")
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
                    func.value.id in OUTPUT_MODULES:
                found.append(f"{where}: {func.value.id}.{func.attr}(...)")
            elif isinstance(func, ast.Attribute) and func.attr == "write" and isinstance(func.value, ast.Attribute) \
                    and func.value.attr in ("stdout", "stderr"):
                found.append(f"{where}: sys.{func.value.attr}.write(...)")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{where}: imports {name}" for name in names if name.split(".")[0] in OUTPUT_MODULES]
    return found


def printing_below_the_command_layer(root: Path) -> list[str]:
    return [call for path in sorted(root.rglob("*.py"))
            if path.relative_to(root).parts[0] not in (COMMAND_LAYER, f"{ENTRY_POINT}.py")
            and path.relative_to(root) != STDERR_HELPER
            for call in output_calls(path)]


def column_layouts(path: Path) -> list[str]:
    """Where a file lays text out in columns: a format spec padding to a width, or str.ljust/rjust/center."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.FormattedValue) and isinstance(node.format_spec, ast.JoinedStr):
            spec = "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.format_spec.values)
            if COLUMN_SPEC.match(spec):
                found.append(((node.lineno, node.col_offset), f"{path}:{node.lineno}: width {spec!r}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("ljust", "rjust", "center"):
            found.append(((node.lineno, node.col_offset), f"{path}:{node.lineno}: .{node.func.attr}(...)"))
    return [where for _, where in sorted(found, key=lambda item: item[0])]  # stable: an f-string's fields in order


def columns_below_the_command_layer(root: Path) -> list[str]:
    return [layout for path in sorted(root.rglob("*.py")) if path.relative_to(root).parts[0] != COMMAND_LAYER
            for layout in column_layouts(path)]


def render_imports_outside_it(root: Path) -> list[str]:
    """What the render package imports of the command layer beyond itself (it turns data into text; the verbs
    call it, not the other way round), and its imports of typer/rich."""
    render = ".".join((root.name, *RENDER.parts))
    return [f"{path}:{line}: imports {module}" for path in sorted((root / RENDER).rglob("*.py"))
            for module, line in imported_modules(path, root)
            if (room_of(module, root.name) == COMMAND_LAYER and module != render
                and not module.startswith(render + "."))
            or module.split(".")[0] in OUTPUT_MODULES]


def misplaced_tests(tests: Path, package: Path) -> list[str]:
    """Test modules (test_*.py) not directly in a folder of `tests` named for a room of `package` (a subpackage, or a
    top-level module such as truth.py) or for one of BESIDE_THE_ROOMS."""
    rooms = {path.name for path in package.iterdir() if (path / "__init__.py").is_file()}
    rooms |= {path.stem for path in package.glob("*.py") if not path.stem.startswith("_")}
    return [str(path.relative_to(tests)) for path in sorted(tests.rglob("test_*.py"))
            if len(path.relative_to(tests).parts) != 2 or path.parent.name not in rooms | set(BESIDE_THE_ROOMS)]


def test_every_test_module_lives_in_its_rooms_folder():
    assert len(list(TESTS.glob("*/test_*.py"))) > 50
    assert misplaced_tests(TESTS, PACKAGE) == []


def test_the_test_folder_check_finds_a_test_outside_the_rooms(tmp_path):
    package, tests = tmp_path / "pkg", tmp_path / "tests"
    for room in ("sim", "store"):
        (package / room).mkdir(parents=True)
        (package / room / "__init__.py").write_text("")
    (package / "truth.py").write_text("")
    for name in ("sim/test_a.py", "truth/test_b.py", "docs/test_c.py", "test_d.py", "spec/test_e.py",
                 "store/deeper/test_f.py", "store/helpers.py"):
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        (tests / name).write_text("")
    assert misplaced_tests(tests, package) == ["spec/test_e.py", "store/deeper/test_f.py", "test_d.py"]


def test_no_import_cycle_between_rooms():
    graph = room_graph(PACKAGE)
    assert {"cli", "loop", "research", "whatif", "trace", "store", "sim", "model", "spec"} <= set(graph)
    assert cycles(graph) == []


def test_no_import_cycle_between_modules():
    graph = module_graph(PACKAGE)
    assert {"hops_calib.loop.ledger", "hops_calib.loop.commits", "hops_calib.store.digests",
            "hops_calib.cli.options"} <= set(graph)
    assert cycles(graph) == []


def test_the_simulator_loads_no_trace_reader_nor_how_a_spec_is_built():
    """`import hops_calib.sim` (in a fresh interpreter) loads nothing of the trace room and of the spec room only the
    schedules' names: the simulator core is pure."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", "import json, sys, hops_calib.sim; print(json.dumps(sorted(sys.modules)))"],
                          capture_output=True, text=True, env=env, cwd=PACKAGE.parent, check=True)
    loaded = [name for name in json.loads(done.stdout) if name.startswith("hops_calib.")]
    assert "hops_calib.sim.simulate" in loaded
    assert [name for name in loaded if name.split(".")[1] == "trace"] == []
    assert [name for name in loaded if name.split(".")[1] == "spec"] == ["hops_calib.spec", "hops_calib.spec.schedules"]


def test_only_the_entry_point_imports_the_command_layer():
    graph = room_graph(PACKAGE)
    importers = {room: f"{edges[COMMAND_LAYER][0]}:{edges[COMMAND_LAYER][1]}" for room, edges in graph.items()
                 if COMMAND_LAYER in edges and room != ENTRY_POINT}
    assert importers == {}


def test_nothing_below_the_command_layer_prints():
    assert printing_below_the_command_layer(PACKAGE) == []


def test_only_the_command_layer_lays_out_text_tables():
    """Rooms return data; text for people, its tables above all, is built in cli/render (and the verbs)."""
    assert columns_below_the_command_layer(PACKAGE) == []


def test_the_render_package_turns_data_into_text_and_nothing_else():
    assert (PACKAGE / RENDER / "__init__.py").is_file()
    assert render_imports_outside_it(PACKAGE) == []
    assert [call for path in sorted((PACKAGE / RENDER).rglob("*.py")) for call in output_calls(path)] == []


def test_every_room_says_what_it_is():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert docstring and len(docstring.split()) >= 5, f"{init} needs a docstring saying what the room holds"


def test_the_checks_find_a_cycle_an_upward_import_and_a_print(tmp_path):
    """The checks above on a package made to break them: they must see each breach, or they prove nothing."""
    package = tmp_path / "pkg"
    for folder in ("cli", "loop", "store"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text(f'"""The {folder} room of a made-up package."""\n')
    (package / "__init__.py").write_text("")
    (package / "store" / "files.py").write_text("def load():\n    from pkg.loop import gate\n    return gate\n")
    (package / "loop" / "gate.py").write_text(
        "import sys\nfrom ..store import files\nfrom pkg import cli\n\n\ndef judge():\n    print('accepted')\n"
        "    sys.stderr.write('x')\n\n\ndef table(rows):\n    return [f'{r.id:03d} {r.name:<12}{r.ms:9.2f}' for r in rows]\n"
        "\n\ndef cell(text):\n    return text.rjust(8)\n")
    (package / "cli" / "verbs.py").write_text("import typer\nfrom pkg.loop.gate import judge\n")
    (package / "cli" / "render").mkdir()
    (package / "cli" / "render" / "__init__.py").write_text("")
    (package / "cli" / "render" / "gate.py").write_text(
        "from pkg.cli.render import tables\nfrom pkg.cli import verbs\n\n\ndef text(x):\n    return f'{x:>10}'\n")
    graph = room_graph(package)
    assert graph["store"] == {"loop": (package / "store" / "files.py", 2)}
    assert set(graph["loop"]) == {"store", "cli"}
    assert cycles(graph) == [["cli", "loop", "store"]]
    assert printing_below_the_command_layer(package) == [f"{package / 'loop' / 'gate.py'}:7: print(...)",
                                                          f"{package / 'loop' / 'gate.py'}:8: sys.stderr.write(...)"]
    gate = package / "loop" / "gate.py"
    assert columns_below_the_command_layer(package) == [f"{gate}:12: width '<12'", f"{gate}:12: width '9.2f'",
                                                        f"{gate}:16: .rjust(...)"]  # the zero-filled id is none
    assert render_imports_outside_it(package) == [f"{package / 'cli' / 'render' / 'gate.py'}:2: imports pkg.cli"]


def test_the_module_check_finds_a_cycle_held_apart_by_a_lazy_import(tmp_path):
    """Two modules of one room that import each other, one of them inside a function (`from . import x` and a
    dotted import among them): the module graph sees the cycle the room graph cannot."""
    package = tmp_path / "pkg"
    (package / "loop").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "loop" / "__init__.py").write_text('"""The loop room of a made-up package."""\nfrom pkg.loop.gate import judge\n')
    (package / "loop" / "gate.py").write_text("from pkg.loop import ledger\n\n\ndef judge():\n    return ledger\n")
    (package / "loop" / "ledger.py").write_text("def append():\n    from . import gate\n    return gate\n")
    (package / "loop" / "score.py").write_text("import pkg.loop.ledger\n")
    graph = module_graph(package)
    assert graph["pkg.loop"] == {"pkg.loop.gate": (package / "loop" / "__init__.py", 2)}
    assert graph["pkg.loop.ledger"] == {"pkg.loop.gate": (package / "loop" / "ledger.py", 2)}
    assert graph["pkg.loop.score"] == {"pkg.loop.ledger": (package / "loop" / "score.py", 1)}
    assert cycles(room_graph(package)) == []
    assert cycles(graph) == [["pkg.loop.gate", "pkg.loop.ledger"]]
