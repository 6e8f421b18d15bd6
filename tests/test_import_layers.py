"""Dependencies point one way: every import in tallow/ (at module level or inside a function)
goes to a module of the same layer or of one below it:

    config, errors -> ops -> attention -> models (with tokenizer, chat_template) -> distributed
    -> engine -> output -> serve -> cli, llm, testing

Imports under `if TYPE_CHECKING:` are annotations only and are not counted (the models name
the distributed package's ParallelContext in annotations; the object is passed in). Two more
rules: nothing imports tallow.testing (test fixtures: it registers itself), and llm.py is a
client of engine + output, never of serve.

An AST walk rather than import-linter: no extra dependency, and the test below checks that the
walk does catch an upward import in a synthetic tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "tallow"

# Lowest first. A module belongs to the first entry that is it or one of its packages.
LAYERS: list[tuple[str, ...]] = [
    ("tallow.config", "tallow.errors"),
    ("tallow.ops",),
    ("tallow.attention",),
    ("tallow.models", "tallow.tokenizer", "tallow.chat_template"),
    ("tallow.distributed",),
    ("tallow.engine",),
    ("tallow.output",),
    ("tallow.serve",),
    ("tallow.cli", "tallow.chat_cli", "tallow.llm", "tallow.testing", "tallow"),  # "tallow": the package's __init__ (the facade)
]


def layer_of(module: str) -> int | None:
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if module == name or (name != "tallow" and module.startswith(name + ".")):
                if best is None or len(name) > best[1]:
                    best = (i, len(name))
    return None if best is None else best[0]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported module) of every import outside `if TYPE_CHECKING:` blocks."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            # `from tallow.models import gguf` imports the module tallow.models.gguf
            found.extend((node.lineno, f"{source}.{alias.name}") for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def violations(root: Path = ROOT) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        mine = layer_of(module)
        if mine is None:
            problems.append(f"{module}: in no layer (add it to LAYERS in tests/test_import_layers.py)")
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for line, imported in imports_of(tree, module, path.name == "__init__.py"):
            if not (imported == "tallow" or imported.startswith("tallow.")):
                continue
            # `from pkg import name`: name is a module or an attribute of pkg (then pkg decides).
            theirs = next((layer_of(p) for p in _prefixes(imported) if layer_of(p) is not None), None)
            where = f"{path.relative_to(root.parent)}:{line}: {module} imports {imported}"
            if theirs is None:
                problems.append(f"{where} (in no layer)")
            elif theirs > mine:
                problems.append(f"{where} (up: layer {theirs} from layer {mine})")
            elif _is_under(imported, "tallow.testing") and not _is_under(module, "tallow.testing"):
                problems.append(f"{where} (only tests import tallow.testing)")
            elif _is_under(module, "tallow.llm") and _is_under(imported, "tallow.serve"):
                problems.append(f"{where} (llm.py is a client of engine + output, never of serve)")
    return problems


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_every_import_in_tallow_points_down_the_layers():
    assert violations() == []


@pytest.mark.parametrize("importer, source, expected", [
    ("models/bad.py", "from tallow.engine.core import EngineCore\n", "up: layer 5 from layer 3"),
    ("attention/bad.py", "def f():\n    import tallow.models.llama\n", "up: layer 3 from layer 2"),
    ("distributed/bad.py", "from tallow.engine import runner\n", "up: layer 5 from layer 4"),
    ("models/bad.py", "from ..engine import core\n", "up: layer 5 from layer 3"),
    ("serve/bad.py", "from tallow.testing import replay\n", "up: layer 8 from layer 7"),
    ("cli.py", "import tallow.testing\n", "only tests import tallow.testing"),
    ("llm.py", "from tallow.serve.app import run_server\n", "never of serve"),
    ("newthing.py", "x = 1\n", "in no layer"),
])
def test_a_synthetic_upward_import_is_caught(tmp_path, importer, source, expected):
    root = tmp_path / "tallow"
    for package in ("", "models", "attention", "distributed", "serve", "engine"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    (root / importer).write_text(source)
    problems = violations(root)
    assert len(problems) == 1 and expected in problems[0], problems


def test_type_checking_imports_and_downward_imports_pass(tmp_path):
    root = tmp_path / "tallow"
    (root / "models").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "models" / "__init__.py").write_text("")
    (root / "models" / "fine.py").write_text(
        "from typing import TYPE_CHECKING\nfrom tallow.attention.metadata import AttentionMetadata\n"
        "from tallow.errors import TallowError\nif TYPE_CHECKING:\n    from tallow.distributed.group import X\n")
    assert violations(root) == []
