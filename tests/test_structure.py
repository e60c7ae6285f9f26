"""The code's own rules that a reader relies on (the README's "How we write code", docs/architecture.md)."""
from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "squareq"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The project's modules ``path`` imports, at module level or inside a function (a local import still ties the
    two files), each named as the module it reaches: ``from .x import y`` reaches ``x.y`` when that is a module."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def documented_layers(text: str) -> list[set[str]]:
    """The layers of the diagram in docs/architecture.md, top first: ``cli → demo → ... → quant → settings | ...``,
    each a set of top-level names (a subpackage or a module of squareq/)."""
    block = re.search(r"```\n(.*?→.*?)\n```", text, re.S)
    assert block, f"{ARCHITECTURE} has no dependency diagram (a fenced line of names joined by →)"
    return [{name.strip() for name in layer.split("|")} for layer in block.group(1).split("→")]


def upward_imports(graph: Mapping[str, Iterable[str]], layers: list[set[str]]) -> list[str]:
    """Every import of a module from a layer above its own (layers are listed top first); the project's root
    module (``squareq``, its version) sits below everything."""
    rank = {name: len(layers) - i for i, layer in enumerate(layers) for name in layer}

    def layer_of(module: str) -> int:
        parts = module.split(".")
        if len(parts) == 1:
            return 0
        top = parts[1]
        assert top in rank, f"squareq/{top} is in no layer of {ARCHITECTURE.name}'s diagram; add it there"
        return rank[top]

    return [f"{src} -> {dst}" for src, targets in sorted(graph.items()) for dst in sorted(targets)
            if layer_of(dst) > layer_of(src)]


def test_no_function_is_longer_than_80_lines():
    """A function a newcomer can read at once (issue 40: runtime/loader.py's load had grown to 85)."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_the_length_rule_sees_a_long_function(tmp_path):
    """The negative control: a function of 81 lines is counted as 81."""
    source = "def f():\n" + "    x = 1\n" * 80
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef))
    assert node.end_lineno - node.lineno + 1 == MAX_FUNCTION_LINES + 1


def _long_files(root: Path) -> list[str]:
    return [f"{p.relative_to(root)} ({n} lines)" for p in sorted(root.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]


def test_no_file_is_longer_than_600_lines(tmp_path):
    """A room a newcomer can read in one sitting (issue 59: train/loop.py had grown to 1,233 lines); the control:
    a file of 601 lines is found."""
    assert not _long_files(PACKAGE)
    (tmp_path / "ok.py").write_text("x = 1\n" * MAX_FILE_LINES)
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    assert _long_files(tmp_path) == [f"long.py ({MAX_FILE_LINES + 1} lines)"]


def test_no_two_modules_import_each_other_even_through_others():
    """No import circle among squareq's files, function-local imports included (issue 59: train/config.py and
    train/kohya_keys.py imported each other)."""
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_circles():
    """The negative control: a loop through three modules is one circle; a chain and a self-import are none."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}}) == []


def test_no_import_runs_up_the_layers_the_architecture_page_gives():
    """Dependencies point one way, in the order docs/architecture.md draws; every top-level part is in a layer."""
    layers = documented_layers(ARCHITECTURE.read_text())
    parts = {p.stem if p.suffix else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert parts <= set().union(*layers), f"not in the diagram: {sorted(parts - set().union(*layers))}"
    assert upward_imports(import_graph(), layers) == []


def test_the_layer_rule_sees_an_import_running_up():
    """The negative control: quant importing train is an upward import; train importing quant is not."""
    layers = documented_layers("```\ntrain | compiler  →  runtime  →  quant\n```")
    graph = {"squareq.quant.rtn": {"squareq.train.loop"}, "squareq.train.loop": {"squareq.quant.rtn", "squareq"}}
    assert upward_imports(graph, layers) == ["squareq.quant.rtn -> squareq.train.loop"]
