"""The shape of the code outside tests: every function and method is at most 50 lines and every module starts
with a docstring, read with `ast` so nothing is imported."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("mesh", "models", "sharding", "train", "checkpoint", "experiments")
SKIPPED = {".venv", "venv", "build", "dist", "__pycache__", ".cache"}  # environments and build outputs
MAX_LINES = 50


def modules() -> list[pathlib.Path]:
    """Every .py file of the packages, outside environments and build folders."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).parts
            if not any(p in SKIPPED or p.endswith(".egg-info") for p in parts):
                found.append(path)
    return found


def parsed() -> list[tuple[str, ast.Module]]:
    return [(str(path.relative_to(ROOT)), ast.parse(path.read_text(), filename=str(path))) for path in modules()]


def function_lengths(tree: ast.Module) -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines) of every function and method, nested ones included; the lines run
    from `def` to the last line of the body, decorators excluded."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child.lineno, child.end_lineno - child.lineno + 1))
            named = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            visit(child, prefix + child.name + "." if named else prefix)
    visit(tree, "")
    return out


def test_the_packages_are_found():
    found = {path.relative_to(ROOT).parts[0] for path in modules()}
    assert found == set(PACKAGES), found


def test_functions_are_at_most_50_lines():
    offenders = [f"{path}:{line} {name}: {lines} lines"
                 for path, tree in parsed() for name, line, lines in function_lengths(tree) if lines > MAX_LINES]
    assert not offenders, f"functions over {MAX_LINES} lines:\n" + "\n".join(offenders)


def test_every_module_starts_with_a_docstring():
    missing = [path for path, tree in parsed() if ast.get_docstring(tree) is None]
    assert not missing, "modules without a docstring:\n" + "\n".join(missing)


def test_the_length_rule_counts_def_to_end_without_decorators():
    tree = ast.parse("@decorator\ndef f():\n    def g():\n        pass\n    return g\n\n"
                     "class C:\n    def m(self):\n        return 1\n")
    assert function_lengths(tree) == [("f", 2, 4), ("f.g", 3, 2), ("C.m", 8, 2)]


CONFIG_NAMES = ("cfg", "model")  # what code calls a family's config: cfg, self.cfg, plan.model, trainer.plan.model


def config_getattrs(tree: ast.Module) -> list[int]:
    """Lines of `getattr(cfg, "field", default)` (or of `...model`): a field read with a fallback, which the
    model contract (models/protocols.py) replaces by a field every family has or a question to the family."""
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) == 3):
            target = node.args[0]
            name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
            if name in CONFIG_NAMES:
                lines.append(node.lineno)
    return lines


def test_no_model_field_is_read_with_a_fallback_outside_models():
    offenders = [f"{path}:{line}" for path, tree in parsed() if not path.startswith("models/")
                 for line in config_getattrs(tree)]
    assert not offenders, "getattr(cfg, ..., default) outside models/:\n" + "\n".join(offenders)


def test_the_fallback_rule_finds_config_getattrs():
    tree = ast.parse("a = getattr(cfg, 'x', 0)\nb = getattr(plan.model, 'y', 1)\nc = getattr(cfg, 'z')\n"
                     "d = getattr(other, 'w', 2)\n")
    assert config_getattrs(tree) == [1, 2]
