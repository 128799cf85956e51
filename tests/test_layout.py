"""The package's shape: data flows one way (data -> regenerate -> dump -> train -> export -> check -> serve ->
bench), so no module imports, at load time, a module that imports it back. Imports inside functions are the
deliberate way to reach later layers (a CLI entry point, an optional dependency) and are not edges here."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_modules(pkg_dir: str) -> dict[str, str]:
    """Dotted module name -> file, for every .py under pkg_dir (packages by their __init__.py)."""
    base = os.path.dirname(pkg_dir)
    out = {}
    for dirpath, _, files in os.walk(pkg_dir):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def load_time_imports(modules: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the package modules it imports when it loads (module-level statements, including those under
    a module-level if/try), plus the packages that hold them (importing a.b.c runs a/b/__init__.py first), except
    the importer's own packages, which are loading already."""
    graph = {}
    for name, path in modules.items():
        is_pkg = path.endswith("__init__.py")
        package = name if is_pkg else name.rpartition(".")[0]
        deps = set()
        tree = ast.parse(open(path).read(), path)
        nodes = []
        for stmt in tree.body:
            nodes += list(ast.walk(stmt)) if isinstance(stmt, (ast.If, ast.Try)) else [stmt]
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    origin = ".".join(parts[:len(parts) - node.level + 1])
                    origin = f"{origin}.{node.module}" if node.module else origin
                else:
                    origin = node.module or ""
                for alias in node.names:
                    sub = f"{origin}.{alias.name}"
                    deps.add(sub if sub in modules else origin)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        holders = {".".join(d.split(".")[:i]) for d in deps for i in range(1, d.count(".") + 1)}
        graph[name] = {d for d in deps | holders if d in modules and d != name and d not in own}
    return graph


def find_cycle(graph: dict[str, set[str]]):
    """One import cycle as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                return stack[stack.index(v):] + [v]
            if v not in state:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        state[u] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "e.py").write_text("from . import a\n")
    (pkg / "sub" / "b.py").write_text("import os\nif True:\n    from ..c import f\n")
    (pkg / "c.py").write_text("def f():\n    from . import a\nfrom .a import g\n")
    (pkg / "d.py").write_text("def h():\n    from .a import g\n")       # inside a function: not an edge
    graph = load_time_imports(package_modules(str(pkg)))
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.e"] == {"pkg.a"}
    assert graph["pkg.d"] == set()
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("def f():\n    from .a import g\n")
    assert find_cycle(load_time_imports(package_modules(str(pkg)))) is None


def test_no_import_cycles_in_the_package():
    modules = package_modules(os.path.join(ROOT, "sglang_eagle3"))
    assert {"sglang_eagle3.draft", "sglang_eagle3.trainer.loop", "sglang_eagle3.dump_reader"} <= set(modules)
    graph = load_time_imports(modules)
    assert "sglang_eagle3.dump_reader" in graph["sglang_eagle3.hidden_dump"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
