"""The code's shape: imports flow one way (no circles) between the modules of bench/ and
methods/, lazy imports inside functions included."""
import ast
from pathlib import Path

from conftest import REPO


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for top in ("bench", "methods") for p in (REPO / top).rglob("*.py")}
    graph = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                           for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_in_bench_and_methods():
    graph = import_graph()
    assert "bench.measure.runner" in graph and graph["bench.measure.runner"]  # it parsed
    assert cycles(graph) == []


def test_measurement_does_not_depend_on_the_config_or_report_layers():
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("bench.measure"):
            assert not {d for d in deps if d.startswith(("bench.suite", "bench.report"))}, name


# What a method may import of bench: the contract, never the tool that measures it (nor
# the config, report or command layers).
CONTRACT = {"bench.method", "bench.hooks", "bench.job"}


def contract_breaches(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(method module, bench module) for each import from methods/ of bench outside the
    contract."""
    return sorted((name, dep) for name, deps in graph.items() if name.split(".")[0] == "methods"
                  for dep in deps if dep.split(".")[0] == "bench" and dep not in CONTRACT)


def test_contract_rule_finds_a_planted_import():
    graph = {"methods.x": {"bench.method", "bench.measure.tracker", "methods._common.optim"},
             "methods.y.graph": {"bench.suite", "bench.hooks", "bench.job"},
             "bench.measure.runner": {"bench.method", "bench.measure.tracker"}}
    assert contract_breaches(graph) == [("methods.x", "bench.measure.tracker"),
                                        ("methods.y.graph", "bench.suite")]


def test_methods_import_only_the_contract_from_bench():
    graph = import_graph()
    assert graph["methods.roam"] and graph["methods._common.torchao"]  # it parsed
    assert contract_breaches(graph) == []
    # the contract itself stays clear of the measuring tool
    for name in CONTRACT:
        assert not {d for d in graph[name] if d.startswith(("bench.measure", "bench.suite",
                                                             "bench.report"))}, name


def test_a_planted_import_of_the_tool_in_a_method_is_caught(tmp_path, monkeypatch):
    files = {"bench/__init__.py": "", "bench/method.py": "", "bench/measure/__init__.py": "",
             "bench/measure/tracker.py": "", "methods/__init__.py": "",
             "methods/fine.py": "from bench.method import Method\n",
             "methods/planted.py": "def step():\n    from bench.measure.tracker import MemoryTracker\n"}
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    monkeypatch.setitem(globals(), "REPO", tmp_path)  # import_graph reads this tree
    assert contract_breaches(import_graph()) == [("methods.planted", "bench.measure.tracker")]
