"""The package's shape: its import graph against the layer list in docs/architecture.md.

Every module of ``mpiattn`` is parsed with :mod:`ast` (nothing is imported);
every import counts, at module level and inside functions, absolute
(``import mpiattn.x``, ``from mpiattn.x import y``) and relative
(``from . import x``, ``from ..x import y``). A name imported from a package
counts as an import of the module the package's ``__init__`` takes it from
(``from .. import __version__`` -> ``mpiattn._version``), and importing
``a.b.c`` also runs the ``__init__`` of package ``a.b``: an edge to it (unless
the importer lives inside ``a.b``, or ``a.b`` is ``mpiattn`` itself).

The tests fail on
(a) a cycle in that graph (module level and function level together),
(b) an import that points up the layer list (the fenced ``layers`` block of
    docs/architecture.md; its grammar is in :func:`parse_layers`), a module
    the list does not place, or a name in the list that is no module,
(c) a module below ``io``/``cli``/``bench`` that touches files, or one below
    ``cli``/``bench`` that prints (``comm.errors``' last words before an abort
    excepted);
(d) a module of more than :data:`MAX_LINES` lines (the number docs/architecture.md
    names, checked to be the same);
and check that no test module imports another, and, in a fresh interpreter,
that ``import mpiattn`` and a NumPy ``attention`` call stay light (no benchmark
or CLI code, no matplotlib, psutil, torch or CuPy, MPI not initialised by the
import).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "mpiattn"
DOC = os.path.join(ROOT, "docs", "architecture.md")


# ------------------------------------------------------------------ modules
def module_files(root: str = ROOT, package: str = PACKAGE) -> dict[str, str]:
    """``{dotted module name: path}`` of every ``.py`` file of the package (``__init__`` -> the package)."""
    out = {}
    base = os.path.join(root, package)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if os.path.exists(os.path.join(dirpath, d, "__init__.py")))
        rel = os.path.relpath(dirpath, root).replace(os.sep, ".")
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                name = rel if fn == "__init__.py" else f"{rel}.{fn[:-3]}"
                out[name] = os.path.join(dirpath, fn)
    return out


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    kind: str  # "module" (runs at import) or "function" (inside a function body)

    def __str__(self) -> str:
        return f"{self.source}:{self.line} -> {self.target} ({self.kind} level)"


class _Imports(ast.NodeVisitor):
    """``(dotted base, [(name, alias)] or None, line, in_function)`` for every import of one module."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, list[tuple[str, str | None]] | None, int, bool]] = []
        self.depth = 0

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, None, node.lineno, self.depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".")
            if node.level - 1 > len(parts) - 1:
                raise ValueError(f"relative import beyond the top-level package at line {node.lineno}")
            base = ".".join(parts[:len(parts) - (node.level - 1)])
            base = f"{base}.{node.module}" if node.module else base
        else:
            base = node.module or ""
        self.found.append((base, [(a.name, a.asname) for a in node.names], node.lineno, self.depth > 0))


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as fh:
        return ast.parse(fh.read(), filename=path)


def reexports(modules: dict[str, str]) -> dict[str, dict[str, str]]:
    """``{package: {name: module it comes from}}`` for the module-level ``from .x import name`` of each ``__init__``."""
    out: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        if not path.endswith("__init__.py"):
            continue
        table = out.setdefault(name, {})
        visitor = _Imports(name, True)
        for node in _parse(path).body:  # module level only
            if isinstance(node, ast.ImportFrom):
                visitor.visit(node)
        for base, names, _, _ in visitor.found:
            if base in modules and names:
                for n, alias in names:
                    table[alias or n] = f"{base}.{n}" if f"{base}.{n}" in modules else base
    return out


def _resolve_name(package: str, name: str, modules: dict, exports: dict, seen=()) -> str:
    """The module that ``from package import name`` really reads."""
    if f"{package}.{name}" in modules:
        return f"{package}.{name}"
    src = exports.get(package, {}).get(name)
    if src is None or src == package or src in seen:
        return package
    if src in exports and name in exports[src] and src not in seen:  # re-exported further down
        return _resolve_name(src, name, modules, exports, (*seen, package))
    return src


def import_graph(modules: dict[str, str], package: str = PACKAGE) -> list[Edge]:
    """Every import edge between modules of the package (see the module docstring)."""
    exports = reexports(modules)
    edges: set[Edge] = set()
    for name, path in modules.items():
        visitor = _Imports(name, path.endswith("__init__.py"))
        visitor.visit(_parse(path))
        for base, names, line, in_function in visitor.found:
            if base != package and not base.startswith(package + "."):
                continue
            kind = "function" if in_function else "module"
            if base not in modules:
                raise AssertionError(f"{name}:{line} imports {base}, which is no module of {package}")
            if names is None or ("*", None) in names:  # import a.b.c: a, a.b and a.b.c all run
                targets = [base]
            else:
                targets = [_resolve_name(base, n, modules, exports) for n, _ in names]
            for t in targets:
                chain = [t]
                parts = t.split(".")
                for i in range(2, len(parts)):  # the packages above t (not the root)
                    chain.append(".".join(parts[:i]))
                for target in chain:
                    if target == name or (name + ".").startswith(target + "."):
                        continue  # itself, or a package it lives in (runs first anyway)
                    edges.add(Edge(name, target, line, kind))
    return sorted(edges, key=lambda e: (e.source, e.line, e.target))


# ------------------------------------------------------------------- cycles
def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (or a self-loop), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1 or node in graph.get(node, ()):
                    out.append(sorted(comp))
    return sorted(out)


def test_find_cycles_on_synthetic_graphs():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"a"}}) == [["a"]]
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "a"}}) == [["a", "b"], ["c", "d"]]
    chain = {str(i): {str(i + 1)} for i in range(3000)}  # deep: no recursion limit
    assert find_cycles(chain) == []
    chain["3000"] = {"0"}
    assert len(find_cycles(chain)[0]) == 3001


# ------------------------------------------------------------------- layers
@dataclass(frozen=True)
class Place:
    key: tuple  # (layer, level in the layer, level inside the subpackage); lower imports nothing higher
    entry: str  # the layer-list entry that places the module


def parse_layers(text: str, package: str = PACKAGE) -> list[tuple[str | None, list[list[str]]]]:
    """The layer list: the first fenced block tagged ``layers``, one layer per line, bottom first.

    A line is either ``name name < name ...`` (modules or packages of the
    package, relative to it; ``mpiattn`` is the package's own ``__init__``) or
    ``sub: name name < name ...`` (the modules of subpackage ``sub``, its
    ``__init__`` above them all; a name there that is a package places its
    modules beside it). ``<`` separates levels (lower first); names on one
    level are peers. A module may import modules on lower lines, on lower or
    the same level of its own line, and, inside its subpackage, on lower or
    the same inner level. ``#`` starts a comment.
    """
    m = re.search(r"^```layers[ \t]*\n(.*?)^```", text, re.S | re.M)
    if not m:
        raise AssertionError("docs/architecture.md has no ```layers block")
    layers = []
    for raw in m.group(1).splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        sub, _, rest = line.rpartition(":")
        levels = [lvl.replace(",", " ").split() for lvl in rest.split("<")]
        if any(not lvl for lvl in levels):
            raise AssertionError(f"empty level in layer line {raw!r}")
        layers.append((sub.strip() or None, levels))
    return layers


def places(layers, modules: dict[str, str], package: str = PACKAGE) -> tuple[dict[str, Place], list[str]]:
    """Where each module sits, and the problems (unknown names, modules placed twice)."""
    out: dict[str, Place] = {}
    problems: list[str] = []

    def put(mod: str, place: Place) -> None:
        if mod in out:
            problems.append(f"{mod} is placed twice ({out[mod].entry} and {place.entry})")
        out[mod] = place

    def full(name: str) -> str:
        return package if name == package else f"{package}.{name}"

    for li, (sub, levels) in enumerate(layers):
        if sub is not None:
            pkg = full(sub)
            if pkg not in modules or not modules[pkg].endswith("__init__.py"):
                problems.append(f"layer list: {sub} is no subpackage")
                continue
            for lj, level in enumerate(levels):
                for name in level:
                    if f"{pkg}.{name}" not in modules:
                        problems.append(f"layer list: {sub}.{name} is no module")
                        continue
                    put(f"{pkg}.{name}", Place((li, 0, lj), f"{sub}: {name}"))
                    if modules[f"{pkg}.{name}"].endswith("__init__.py"):  # a nested package: its
                        for other in modules:                            # modules are its peers
                            if other.startswith(f"{pkg}.{name}."):
                                put(other, Place((li, 0, lj), f"{sub}: {name}"))
            put(pkg, Place((li, 0, len(levels)), f"{sub}: (__init__)"))
            continue
        for lj, level in enumerate(levels):
            for name in level:
                mod = full(name)
                if mod not in modules:
                    problems.append(f"layer list: {name} is no module")
                    continue
                put(mod, Place((li, lj, 0), name))
                if modules[mod].endswith("__init__.py") and mod != package:  # a subpackage, no inner order
                    for other in modules:
                        if other.startswith(mod + "."):
                            put(other, Place((li, lj, 0), name))
    return out, problems


@pytest.fixture(scope="module")
def package_graph():
    modules = module_files()
    return modules, import_graph(modules)


def test_the_package_has_no_import_cycle(package_graph):
    modules, edges = package_graph
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        graph[e.source].add(e.target)
    cycles = find_cycles(graph)
    report = []
    for comp in cycles:
        inside = [str(e) for e in edges if e.source in comp and e.target in comp]
        report.append(f"cycle through {', '.join(comp)}:\n    " + "\n    ".join(inside))
    assert not cycles, "import cycles:\n" + "\n".join(report)


def test_imports_point_down_the_layer_list(package_graph):
    modules, edges = package_graph
    with open(DOC, encoding="utf-8") as fh:
        layers = parse_layers(fh.read())
    where, problems = places(layers, modules)
    problems += [f"{m} is not in the layer list of docs/architecture.md" for m in modules if m not in where]
    for e in edges:
        a, b = where.get(e.source), where.get(e.target)
        if a is not None and b is not None and b.key > a.key:
            problems.append(f"{e}: points up, from '{a.entry}' to '{b.entry}'")
    assert not problems, "\n".join(problems)


def test_a_cycle_and_an_upward_import_are_caught(tmp_path):
    """The checks above on a scratch package that has both defects."""
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from ._version import v as version\n",
        "_version.py": "v = 1\n",
        "low.py": "def f():\n    from .high import g  # function level, up\n",
        "high.py": "from . import low, version\nfrom .sub import b\n",
        "sub/__init__.py": "from .a import x\n",
        "sub/a.py": "from .b import y\nx = 1\n",
        "sub/b.py": "def y():\n    import toy.sub.a\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    modules = module_files(str(tmp_path), "toy")
    assert sorted(modules) == ["toy", "toy._version", "toy.high", "toy.low", "toy.sub", "toy.sub.a", "toy.sub.b"]
    edges = import_graph(modules, "toy")
    assert Edge("toy", "toy._version", 1, "module") in edges
    assert Edge("toy.high", "toy._version", 1, "module") in edges  # through the package's re-export
    assert Edge("toy.high", "toy.sub", 2, "module") in edges  # the package above toy.sub.b runs too
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
    assert find_cycles(graph) == [["toy.high", "toy.low"], ["toy.sub.a", "toy.sub.b"]]
    layers = parse_layers("```layers\n_version\nsub: b < a  # a comment\nlow\nhigh\ntoy\n```\n", "toy")
    where, problems = places(layers, modules, "toy")
    assert problems == [] and sorted(where) == sorted(modules)
    up = [str(e) for e in edges if where[e.target].key > where[e.source].key]
    assert up == ["toy.low:2 -> toy.high (function level)", "toy.sub.b:2 -> toy.sub.a (function level)"]
    _, problems = places(parse_layers("```layers\nlow\nsub: zz\n```\n", "toy"), modules, "toy")
    assert problems == ["layer list: sub.zz is no module"]


# ------------------------------------------------------------------- sizes
#: The most lines a module of the package may have (docs/architecture.md: "500 lines at most").
MAX_LINES = 500


def long_modules(modules: dict[str, str], limit: int = MAX_LINES) -> list[str]:
    """``"name: N lines"`` for every module of more than ``limit`` lines, longest first."""
    sizes = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as fh:
            sizes[name] = len(fh.read().splitlines())
    return [f"{name}: {n} lines" for name, n in sorted(sizes.items(), key=lambda kv: -kv[1]) if n > limit]


def test_no_module_is_over_the_limit():
    """Every module reads in one sitting: split one that grows past :data:`MAX_LINES` by idea."""
    with open(DOC, encoding="utf-8") as fh:
        said = re.search(r"(\d+) lines at most", fh.read())
    assert said and int(said.group(1)) == MAX_LINES, "docs/architecture.md names another limit"
    long = long_modules(module_files())
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(long)


# ------------------------------------------------------- files and printing
_FILE_CALLS = {("open",), ("h5py", "File"), ("io", "open"), *(("os", f) for f in (
    "remove", "unlink", "rename", "replace", "makedirs", "mkdir", "rmdir", "open"))}
_FILE_MODULES = ("shutil", "tempfile")
_MAY_TOUCH_FILES = ("mpiattn.io", "mpiattn.cli", "mpiattn.bench")
_MAY_PRINT = ("mpiattn.cli", "mpiattn.bench")
#: The one exception to "only cli and bench print": a rank aborting the job says why, on stderr.
_PRINT_EXCEPTIONS = {"mpiattn.comm.errors"}


def _dotted(node: ast.AST) -> tuple[str, ...]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return tuple(reversed(parts))
    return ()


def side_effects(path: str) -> tuple[list[str], list[str]]:
    """``(file operations, printing)`` found in one module, as ``"line: what"``."""
    files, prints = [], []
    for node in ast.walk(_parse(path)):
        at = (node.lineno, node.col_offset) if hasattr(node, "lineno") else (0, 0)
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in _FILE_CALLS or (len(name) > 1 and name[0] in _FILE_MODULES):
                files.append((at, f"{node.lineno}: {'.'.join(name)}()"))
            if name == ("print",):
                prints.append((at, f"{node.lineno}: print()"))
        elif isinstance(node, ast.Attribute) and _dotted(node) in (("sys", "stdout"), ("sys", "stderr")):
            prints.append((at, f"{node.lineno}: {'.'.join(_dotted(node))}"))
    return [t for _, t in sorted(files)], [t for _, t in sorted(prints)]


def _inside(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_only_io_cli_and_bench_touch_files_and_only_cli_and_bench_print():
    problems = []
    for name, path in module_files().items():
        files, prints = side_effects(path)
        if files and not _inside(name, _MAY_TOUCH_FILES):
            problems += [f"{name}:{f} (only io, cli and bench touch files)" for f in files]
        if prints and not _inside(name, _MAY_PRINT) and name not in _PRINT_EXCEPTIONS:
            problems += [f"{name}:{p} (only cli and bench print)" for p in prints]
    assert not problems, "\n".join(problems)


def process_hooks(path: str) -> list[str]:
    """Assignments to ``sys.excepthook``/``sys.unraisablehook`` and ``signal.signal()`` calls."""
    found = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if _dotted(e) in (("sys", "excepthook"), ("sys", "unraisablehook")):
                        found.append(f"{node.lineno}: {'.'.join(_dotted(e))} =")
        elif isinstance(node, ast.Call) and _dotted(node.func) in (("signal", "signal"),
                                                                     ("signal", "set_wakeup_fd")):
            found.append(f"{node.lineno}: {'.'.join(_dotted(node.func))}()")
    return found


def test_only_the_command_line_replaces_process_hooks(tmp_path):
    """The library never replaces a process-wide hook: Python's exception hooks, signal handlers."""
    bad = [f"{name}:{h}" for name, path in module_files().items() if not _inside(name, ("mpiattn.cli",))
           for h in process_hooks(path)]
    assert not bad, "\n".join(bad)
    probe = tmp_path / "m.py"
    probe.write_text("import sys, signal\nsys.excepthook, x = None, 1\nsignal.signal(2, None)\n")
    assert process_hooks(str(probe)) == ["2: sys.excepthook =", "3: signal.signal()"]


def test_side_effects_are_found(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os, sys, shutil, h5py\n"
                   "def f(p):\n    with open(p) as fh:\n        print(fh.read(), file=sys.stderr)\n"
                   "    os.replace(p, p + '~'); shutil.rmtree(p); h5py.File(p, 'w')\n")
    files, prints = side_effects(str(src))
    assert files == ["3: open()", "5: os.replace()", "5: shutil.rmtree()", "5: h5py.File()"]
    assert prints == ["4: print()", "4: sys.stderr"]


def test_no_test_module_imports_another():
    """Tests share code through tests/helpers.py and tests/conftest.py's fixtures only."""
    tests = os.path.join(ROOT, "tests")
    names = {fn[:-3] for _, _, files in os.walk(tests) for fn in files
             if fn.endswith(".py") and (fn.startswith("test_") or fn == "conftest.py")}
    bad = []
    for dirpath, _, files in os.walk(tests):
        for fn in files:
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            for node in ast.walk(_parse(path)):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                for m in mods:
                    if m.split(".")[0] in names or m.startswith("tests."):
                        bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} imports {m}")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------- a light import
_HEAVY = ("mpiattn.bench", "mpiattn.cli", "matplotlib", "psutil", "torch", "cupy")

_PROBE = """
import json, sys
heavy = {heavy!r}
def loaded():
    return sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))
import numpy as np
import mpiattn
after_import = loaded()
mpi_at_import = "mpi4py.MPI" in sys.modules
q = np.random.default_rng(0).standard_normal((1, 2, 8, 4))
out, lse = mpiattn.attention(q, q, q, causal=True{kw})
from mpi4py import MPI
print(json.dumps({{"after_import": after_import, "mpi_at_import": mpi_at_import,
                  "after_call": loaded(), "mpi_initialized": MPI.Is_initialized(),
                  "finite": bool(np.isfinite(out).all())}}))
"""


def _probe(kw: str) -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith("MPIATTN_")}
    fake_site = os.path.join(ROOT, "tests", "fake_site")  # jobs/gpu_check.sh --dry-run preloads a fake CuPy
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and os.path.realpath(p) != os.path.realpath(fake_site))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_PROBE.format(heavy=_HEAVY, kw=kw))],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_and_a_numpy_call_stay_light(serial_only):
    got = _probe(', engine="native"')
    assert got["after_import"] == [] and not got["mpi_at_import"], got  # import mpiattn: nothing heavy, no MPI
    assert got["after_call"] == [] and got["mpi_initialized"] and got["finite"], got


def test_a_default_numpy_call_imports_no_torch(serial_only):
    got = _probe("")
    assert got["after_import"] == [] and not got["mpi_at_import"], got
    assert got["after_call"] == [], got
