"""The import graph of the project's packages, read with `ast` (imports inside functions included): no cycles,
and imports flow downward only (shared/CONVENTIONS.md: train -> checkpoint, sharding, models, mesh)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("mesh", "models", "sharding", "train", "checkpoint", "experiments")


def _modules() -> dict[str, pathlib.Path]:
    """{dotted module name: file}; a package is its __init__."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(node: ast.AST, modules: dict[str, pathlib.Path]) -> set[str]:
    """Our modules one import statement loads: `from pkg import name` counts the submodule pkg.name when there is
    one, else pkg itself; `import a.b.c` counts a.b.c."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    if not isinstance(node, ast.ImportFrom) or node.level or node.module not in modules:
        return set()
    return {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set().union(*(_targets(node, modules) for node in ast.walk(tree)))
        graph[name] = edges - {name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a closed path."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, c) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A closed path inside a strongly connected component, found by walking edges until a module repeats."""
    path = [min(component)]
    while path.count(path[-1]) < 2:
        path.append(min(w for w in graph[path[-1]] if w in component))
    return path[path.index(path[-1]):]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


# Which packages each package may import (CONVENTIONS.md): models and mesh nothing of ours (models only the
# error base and ceil_div), checkpoint at most mesh, sharding only models and mesh, train not experiments.
ALLOWED = {
    "mesh": {"mesh"},
    "models": {"models"},
    "checkpoint": {"checkpoint", "mesh"},
    "sharding": {"sharding", "models", "mesh"},
    "train": {"train", "checkpoint", "sharding", "models", "mesh"},
    "experiments": set(PACKAGES),
}
# Every package derives its user errors from mesh.errors.UserError, and divides with mesh.numbers.ceil_div.
EXCEPTIONS = {("models", "mesh.errors"), ("models", "mesh.numbers")}


def test_imports_flow_downward():
    wrong = []
    for module, edges in import_graph().items():
        package = module.split(".")[0]
        for target in sorted(edges):
            if target.split(".")[0] not in ALLOWED[package] and (package, target) not in EXCEPTIONS:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "; ".join(wrong)


# train/'s own parts, highest first: a part imports only parts below it. The commands (`python -m train.X`, each a
# package with a `__main__.py`) stand on top; the exit statuses and the command line's error mapping at the bottom,
# where every part reads them.
TRAIN_ORDER = (
    "rl",          # python -m train.rl: the training command's start-up and loop with a trainer of its own
    "__main__", "launch", "prepare", "sample", "export_hf",  # commands that nothing imports but train.rl
    "eval",        # lm-evaluation-harness on a placed model (its command too)
    "loop",        # the training loop: scheduler, actions, saver, resume
    "plan",        # layout search, memory and time models (the train.plan command too)
    "serve",       # the serving engine: paged KV cache, continuous batching (its command too)
    "trainer",     # a placed model + optimizer, data and jitted steps
    "step",
    "placed",      # a model on a mesh with its params, no training
    "lora",        # a LoRA run's frozen base, read from its source
    "state",
    "config",      # settings declared once, the sections and model keys, a config validated into a Plan
    "hf",          # Hugging Face config.json, tensors and directories
    "data",
    "runtime",
    "cli",
    "exit_codes",
)


def train_part(module: str) -> str | None:
    """`train.loop.runner` -> `loop`, `train.config` -> `config`; None outside train/ and for train itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "train" and len(parts) > 1 else None


def test_every_part_of_train_has_a_place_in_the_order():
    parts = {train_part(m) for m in import_graph()} - {None}
    assert parts <= set(TRAIN_ORDER), f"place these in TRAIN_ORDER: {sorted(parts - set(TRAIN_ORDER))}"


def test_imports_inside_train_flow_downward():
    rank = {part: i for i, part in enumerate(TRAIN_ORDER)}
    upward = [f"{module} imports {target}" for module, edges in import_graph().items() for target in sorted(edges)
              if (a := train_part(module)) in rank and (b := train_part(target)) in rank and a != b
              and rank[b] <= rank[a]]
    assert not upward, "imports that run up inside train/ (TRAIN_ORDER): " + "; ".join(upward)
