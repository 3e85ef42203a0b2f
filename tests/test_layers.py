"""The package's import graph: no cycle between its parts and no edge from a lower layer to a higher one (issue 18).

Data flows one way (docs/architecture.md): models -> engine -> strategies / probe -> store -> analysis -> plots,
widgets, CLI. Every import counts, those inside functions too (a lazy import is still a dependency), except those
under ``if TYPE_CHECKING:``.
"""
import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mar_probe"

# lowest first; a part may import parts of its own layer or below, never above
LAYERS = (
    ("_config", "_io", "_version", "launch", "machine", "vocab"),
    ("data", "models", "hooks"),
    ("engine", "store"),
    ("strategies",),
    ("sampler", "api"),
    ("probe", "quality"),
    ("analysis",),
    ("compare", "ablation", "tune", "train", "plot"),
    ("study", "widgets"),
    ("cli", "__main__", "__init__"),
)
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def _module(path: Path) -> tuple[str, ...]:
    rel = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return rel[:-1] if rel[-1] == "__init__" else rel


def _type_checking_lines(tree) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def _targets(path: Path):
    """The mar_probe modules that ``path`` imports (``from .. import analysis`` names the module analysis)."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module[:-1]
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (tuple(a.name.split(".")) for a in node.names if a.name.split(".")[0] == "mar_probe")
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            target = base + tuple((node.module or "").split(".")) if node.module else base
            if target and target[0] == "mar_probe":
                yield from (target + (a.name,) if (PACKAGE.parent.joinpath(*target, a.name)).exists()
                            or PACKAGE.parent.joinpath(*target, a.name + ".py").exists() else target
                            for a in node.names)


def _part(module: tuple[str, ...]) -> str:
    return module[1] if len(module) > 1 else "__init__"


def part_graph() -> dict[str, set[str]]:
    graph = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        src = _part(_module(path))
        for target in _targets(path):
            dst = _part(target)
            if dst != src:
                graph[src].add(dst)
    return graph


def test_every_part_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert parts - set(LAYER) == set(), "give each new module or subpackage a layer in LAYERS"


def test_no_import_goes_up_a_layer():
    upward = sorted((src, dst) for src, dsts in part_graph().items() for dst in dsts if LAYER[dst] > LAYER[src])
    assert upward == [], f"imports from a lower layer to a higher one: {upward}"


def test_no_cycle_between_parts():
    graph = part_graph()
    state: dict[str, int] = {}

    def visit(node, trail):
        if state.get(node) == 1:
            pytest.fail(f"import cycle: {' -> '.join(trail[trail.index(node):] + [node])}")
        if state.get(node) == 2:
            return
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, trail + [node])
        state[node] = 2

    for node in sorted(graph):
        visit(node, [])


def test_the_checker_sees_lazy_relative_and_parent_imports(tmp_path):
    """The graph is real: the known edges are found, whichever import form makes them."""
    graph = part_graph()
    assert "store" in graph["analysis"]          # from ..store import ... (module level)
    assert "analysis" in graph["plot"]           # from .. import analysis as A
    assert "probe" in graph["compare"]           # from .probe.record import ... inside a function
    assert "engine" in graph["api"]
