"""The import directions between llmsys's packages, read from the source (AST), not from a running import.

Why: the layering is what lets a kernel, a quantized format or an offload tier change without the
engine's model code in the way, and it erodes one convenient import at a time. Every import is
counted: top-level, inside functions (lazy imports) and under ``TYPE_CHECKING`` alike, plus
``importlib.import_module("llmsys....")`` with a literal name.

Allowed (``A -> B``: A may import B)::

    kernels/common  ->  (nothing in llmsys)
    kernels         ->  kernels/common
    quant           ->  kernels
    offload         ->  kernels, quant
    engine          ->  kernels, quant, offload        (engine/ but its front ends below)
    engine/server   ->  engine and below               (the HTTP front end)
    engine/bench    ->  engine and below               (``llmsys bench``)
    tui             ->  engine and below
    engine/cli      ->  every front end and below      (the ``llmsys`` command starts them all)

quant <-> offload: offload places and streams quantized layers (its README lists ``llmsys.quant``
among its imports) while quant has no use for tiers, so only ``offload -> quant`` is allowed; today
neither imports the other. The root ``__init__.py`` (``llmsys.LLM`` ...) is the public face above
everything and no package may import it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "quant", "offload", "engine", "tui")
COMMON = "kernels.common"
# Sub-packages that are layers of their own: the bottom layer, and the engine's front ends.
SUBLAYERS = {("kernels", "common"), ("engine", "server"), ("engine", "bench"), ("engine", "cli")}
_BELOW_ENGINE = {"kernels", COMMON, "quant", "offload"}
ALLOWED: dict[str, set[str]] = {
    COMMON: set(),
    "kernels": {COMMON},
    "quant": {"kernels", COMMON},
    "offload": {"kernels", COMMON, "quant"},
    "engine": _BELOW_ENGINE,
    "engine.server": _BELOW_ENGINE | {"engine"},
    "engine.bench": _BELOW_ENGINE | {"engine"},
    "tui": _BELOW_ENGINE | {"engine"},
    "engine.cli": _BELOW_ENGINE | {"engine", "engine.server", "engine.bench", "tui"},
}
# Names a module outside kernels/ may import kernels through: the package itself (its __init__
# lists the public ops), the validating wrappers, and the bottom layer.
PUBLIC_KERNELS = ("llmsys.kernels", "llmsys.kernels.ops", "llmsys.kernels.common")


def _package(rel: Path) -> str | None:
    """``kernels/common/x.py -> "kernels.common"``, ``quant/int4.py -> "quant"``, others None."""
    parts = rel.parts
    if parts[0] not in PACKAGES or len(parts) < 2:
        return None
    return ".".join(parts[:2]) if tuple(parts[:2]) in SUBLAYERS else parts[0]


def _target(module: str) -> str | None:
    """The package an ``llmsys.*`` module name belongs to (``"root"`` for ``llmsys`` itself)."""
    parts = module.split(".")
    if parts[0] != "llmsys":
        return None
    if len(parts) == 1:
        return "root"
    if parts[1] not in PACKAGES:
        return "root"
    return ".".join(parts[1:3]) if tuple(parts[1:3]) in SUBLAYERS else parts[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, dotted module)`` for every llmsys import in ``path`` (``from llmsys import kernels``
    counts as ``llmsys.kernels``; relative imports are resolved against the file's package)."""
    rel = path.relative_to(ROOT)
    here = ["llmsys", *rel.with_suffix("").parts]
    if here[-1] == "__init__":
        here = here[:-1]
    else:
        here = here[:-1]  # the package the module is in
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                out.append((node.lineno, f"{base}.{a.name}" if _is_submodule(f"{base}.{a.name}") else base))
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "kernels"
              and _is_submodule(f"llmsys.kernels.{node.attr}")):  # `from llmsys import kernels` then kernels.x.y
            out.append((node.lineno, f"llmsys.kernels.{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.lineno, node.args[0].value))
    return sorted({(line, m) for line, m in out if m == "llmsys" or m.startswith("llmsys.")})


def _is_submodule(dotted: str) -> bool:
    """Whether ``llmsys.a.b`` names a module or package file (so ``from llmsys.a import b`` imports it)."""
    parts = dotted.split(".")
    if parts[0] != "llmsys":
        return False
    p = ROOT.joinpath(*parts[1:])
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _edges() -> list[tuple[str, str, str, int, str]]:
    """``(from package, to package, file, line, module)`` for every import between two packages."""
    edges = []
    for path in _sources():
        rel = path.relative_to(ROOT)
        src = _package(rel)
        for line, module in _imports(path):
            dst = _target(module)
            if src is not None and dst is not None and dst != src:
                edges.append((src, dst, rel.as_posix(), line, module))
    return edges


def test_sources_are_found():
    files = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert {"kernels/common/errors.py", "quant/int4.py", "offload/plan.py", "engine/core.py"} <= files
    assert any(src == "engine" and dst == "kernels" for src, dst, *_ in _edges())


def test_imports_point_down():
    bad = [f"{file}:{line}: {src} imports {module} ({dst})" for src, dst, file, line, module in _edges()
           if dst not in ALLOWED[src]]
    assert not bad, "imports against the layering (see this file's docstring):\n" + "\n".join(bad)


def test_no_cycles_between_packages():
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for src, dst, file, line, module in _edges():
        graph.setdefault(src, set()).add(dst)
        where.setdefault((src, dst), f"{file}:{line} ({module})")
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cyc = path[path.index(nxt):] + [nxt]
                cycles.append(" -> ".join(cyc) + ": " + "; ".join(where[(a, b)] for a, b in zip(cyc, cyc[1:])))
            else:
                visit(nxt, path + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, "package import cycles:\n" + "\n".join(sorted(set(cycles)))


def test_kernels_are_called_through_public_names():
    """Outside kernels/, only ``llmsys.kernels`` (its ``__all__``), ``kernels/ops.py`` and ``kernels/common``."""
    import llmsys.kernels as K

    public = set(K.__all__)
    bad = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("kernels/"):
            continue
        tree = ast.parse(path.read_text(), rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "llmsys.kernels":
                names = [a.name for a in node.names
                         if a.name not in public and not _is_submodule(f"llmsys.kernels.{a.name}")]
                bad += [f"{rel}:{node.lineno}: from llmsys.kernels import {n} (not in llmsys.kernels.__all__)"
                        for n in names]
            # `from llmsys import kernels` then `kernels.cpu_linear.f(...)`: a private module by attribute
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "kernels"
                    and node.attr not in public and _is_submodule(f"llmsys.kernels.{node.attr}")
                    and node.attr not in ("ops", "common")):
                bad.append(f"{rel}:{node.lineno}: kernels.{node.attr} (a private kernel module)")
        for line, module in _imports(path):
            if not module.startswith("llmsys.kernels.") or module.startswith(PUBLIC_KERNELS[1:]):
                continue
            bad.append(f"{rel}:{line}: imports the private kernel module {module}")
    assert not bad, "kernels called around kernels/ops.py and llmsys.kernels:\n" + "\n".join(bad)
