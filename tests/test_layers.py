"""The layers hold: every import under ``omni_jax/`` is read (with ``ast``, imports inside functions
included, relative ones resolved) and checked against the layering of docs/ARCHITECTURE.md.

From the top: the pipeline with what drives its stages (the engine core, its thread, request
intake, the async pipeline) and the composition root (:mod:`omni_jax.architectures`, which says
which architecture builds which stages), then ``stages/``, then ``engine/``, then ``models/``.
A layer never imports one above it:

- ``models/`` imports no engine, no stage, no pipeline, no composition root;
- ``engine/`` imports no stage, no pipeline, no composition root and no model family. The engine
  may use the model layer's generic building blocks (:data:`GENERIC_MODEL_MODULES`: attention
  metadata and backends, layers, parameter maps and loading), which know no architecture; every
  other module under ``models/`` (``qwen2.py``, ``qwen2_5_omni/``, any new one until it is listed
  here as generic) is a family;
- ``stages/`` imports no pipeline and no composition root (it imports stages).

No layer below the top imports the package root ``omni_jax`` itself: it is the public API and
imports the pipeline. Modules beside the layers (``parallel/``, ``kernels/``, ``jit.py``,
``profiling.py``, ...) may be imported by any of them, so a layer may not reach a forbidden
module through them either: the check follows chains of imports, and a failure names the chain.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

PACKAGE = "omni_jax"
SOURCE = Path(__file__).resolve().parents[1] / PACKAGE

TOP = (
    "omni_jax.pipeline",
    "omni_jax.async_pipeline",
    "omni_jax.engine_core",
    "omni_jax.engine_thread",
    "omni_jax.intake",
    "omni_jax.architectures",
)
GENERIC_MODEL_MODULES = ("attention", "layers", "param_map", "loading")
"""Modules under ``omni_jax/models/`` that are no model family: the engine may import them."""


def module_paths(root: Path = SOURCE) -> dict[str, Path]:
    """Every module of the package (directories too, namespace packages included) by dotted name."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
        for i in range(1, len(parts)):
            found.setdefault(".".join(parts[:i]), path.parent)  # a package without __init__.py
    return found


MODULES = module_paths()


def imports(
    source: str, module: str, is_package: bool, known: set[str] | None = None
) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import statement in ``source`` (the text of
    ``module``), wherever it stands. ``from X import Y`` imports ``X.Y`` when that is a module
    of the package (``known``), else ``X``; relative imports are resolved against ``module``."""
    known = set(MODULES) if known is None else known
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in known else base, node.lineno))
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _is_family(name: str) -> bool:
    if not name.startswith("omni_jax.models."):
        return False
    return name.split(".")[2] not in GENERIC_MODEL_MODULES


def forbidden(importer: str, imported: str) -> str | None:
    """Why ``importer`` may not import ``imported`` (both dotted module names); ``None`` if it may."""
    if _under(importer, "omni_jax.models"):
        layer, banned = "models/", ("omni_jax.engine", "omni_jax.stages", *TOP)
    elif _under(importer, "omni_jax.engine"):
        layer, banned = "engine/", ("omni_jax.stages", *TOP)
        if _is_family(imported):
            return "engine/ imports no model family"
    elif _under(importer, "omni_jax.stages"):
        layer, banned = "stages/", TOP
    else:
        return None
    if imported == PACKAGE:
        return f"{layer} does not import the package root (it imports the pipeline)"
    for b in banned:
        if _under(imported, b):
            return f"{layer} imports no {b}"
    return None


def _known(name: str) -> str | None:
    """The package module an imported name loads (longest known prefix); ``None`` outside it."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in MODULES:
            return ".".join(parts[:i])
    return None


def import_graph() -> dict[str, list[tuple[str, int]]]:
    """Each file module's imports of package modules, with their lines."""
    graph = {}
    for name, path in MODULES.items():
        if path.is_dir():
            continue
        pairs = imports(path.read_text(), name, path.name == "__init__.py")
        graph[name] = [(m, line) for imported, line in pairs if (m := _known(imported)) is not None]
    return graph


def violations(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Every module of a layer that imports, directly or through modules the rules allow it, one
    it may not; each named once, with the shortest chain of imports (``module:line``) that reaches it."""
    found = []
    for start in sorted(graph):
        seen, reported = {start}, set()
        queue = collections.deque([(start, [start])])
        while queue:
            module, chain = queue.popleft()
            for imported, line in graph.get(module, []):
                step = [*chain[:-1], f"{chain[-1]}:{line}", imported]
                why = forbidden(start, imported)
                if why is not None and imported not in reported:
                    reported.add(imported)
                    found.append(f"{' -> '.join(step)}: {why}")
                elif why is None and imported not in seen:
                    seen.add(imported)
                    queue.append((imported, step))
    return found


def test_layers_hold() -> None:
    found = violations(import_graph())
    assert not found, "layering violations:\n" + "\n".join(found)


def test_the_walk_sees_the_package() -> None:
    """The check reads the real tree: every layer is there, and known imports are found."""
    graph = import_graph()
    for layer in ("omni_jax.models.", "omni_jax.engine.", "omni_jax.stages."):
        assert sum(m.startswith(layer) for m in graph) >= 3, layer
    assert any(m == "omni_jax.stages.base" for m, _ in graph["omni_jax.stages.ar"])
    assert any(m == "omni_jax.models.attention" for m, _ in graph["omni_jax.engine.ar_runner"])


SERVE_BANNED = ("omni_jax.stages", "omni_jax.engine", "omni_jax.models", "omni_jax.architectures")


def serve_violations(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    """``omni_jax/serve/`` (the HTTP server) reaches the library through the top layer only, never
    a stage, engine, model or the composition root directly; and only the command line
    (``omni_jax.cli``) imports it, so its dependencies (FastAPI, uvicorn) stay an extra."""
    found = []
    for module, edges in sorted(graph.items()):
        for imported, line in edges:
            if _under(module, "omni_jax.serve") and any(_under(imported, b) for b in SERVE_BANNED):
                found.append(f"{module}:{line} -> {imported}: serve/ goes through the top layer")
            elif _under(imported, "omni_jax.serve") and not (
                _under(module, "omni_jax.serve") or module == "omni_jax.cli"
            ):
                found.append(f"{module}:{line} -> {imported}: only the command line imports serve/")
    return found


def test_serve_sits_on_the_top_layer() -> None:
    found = serve_violations(import_graph())
    assert not found, "serve/ layering violations:\n" + "\n".join(found)
    graph = import_graph()
    assert any(_under(m, "omni_jax.async_pipeline") for m, _ in graph["omni_jax.serve.app"])


def test_serve_violations_are_named() -> None:
    graph = {
        "omni_jax.serve.app": [("omni_jax.stages.base", 3), ("omni_jax.async_pipeline", 4)],
        "omni_jax.pipeline": [("omni_jax.serve.app", 7)],
        "omni_jax.cli": [("omni_jax.serve.cli", 9)],
    }
    assert serve_violations(graph) == [
        "omni_jax.pipeline:7 -> omni_jax.serve.app: only the command line imports serve/",
        "omni_jax.serve.app:3 -> omni_jax.stages.base: serve/ goes through the top layer",
    ]


SYNTHETIC = {
    "omni_jax.models.fake": ("from omni_jax.engine.compilation import CompileCounter\n", False),
    "omni_jax.models.lazy": ("def f():\n    from ..stages import base\n    return base\n", False),
    "omni_jax.models.root": ("import omni_jax\n", False),
    "omni_jax.engine.family": ("from omni_jax.models.qwen2_5_omni.token2wav import Token2Wav\n", False),
    "omni_jax.engine.generic": ("from omni_jax.models.attention import AttentionMetadata\n", False),
    "omni_jax.engine.relative": ("from ..models import qwen2\n", False),
    "omni_jax.engine.composed": ("from omni_jax import architectures\n", False),
    "omni_jax.stages.up": ("if True:\n    import omni_jax.pipeline as p\n", False),
    "omni_jax.stages.down": ("from .base import StageInput\nfrom omni_jax.engine import step\n", False),
    "omni_jax.neutral": ("from omni_jax.stages.base import StageInput\n", False),
    "omni_jax.models.via": ("from omni_jax import neutral\n", False),
}


def synthetic_graph() -> dict[str, list[tuple[str, int]]]:
    known = set(MODULES) | set(SYNTHETIC)
    return {
        name: [(m, line) for m, line in imports(source, name, is_package, known) if m.startswith(PACKAGE)]
        for name, (source, is_package) in SYNTHETIC.items()
    }


@pytest.mark.parametrize(
    "module,expected",
    [
        ("omni_jax.models.fake", "omni_jax.models.fake:1 -> omni_jax.engine.compilation: models/ imports no"),
        ("omni_jax.models.lazy", "omni_jax.models.lazy:2 -> omni_jax.stages.base: models/ imports no"),
        ("omni_jax.models.root", "omni_jax.models.root:1 -> omni_jax: models/ does not import the package"),
        (
            "omni_jax.engine.family",
            "-> omni_jax.models.qwen2_5_omni.token2wav: engine/ imports no model family",
        ),
        ("omni_jax.engine.relative", "-> omni_jax.models.qwen2: engine/ imports no model family"),
        ("omni_jax.engine.composed", "-> omni_jax.architectures: engine/ imports no omni_jax.architectures"),
        (
            "omni_jax.stages.up",
            "omni_jax.stages.up:2 -> omni_jax.pipeline: stages/ imports no omni_jax.pipeline",
        ),
        (
            "omni_jax.models.via",
            "omni_jax.models.via:1 -> omni_jax.neutral:1 -> omni_jax.stages.base: models/ imports no",
        ),
    ],
)
def test_a_violation_is_named(module: str, expected: str) -> None:
    """The checker on synthetic sources: each banned import fails, named by module, line and chain."""
    found = [v for v in violations(synthetic_graph()) if v.startswith(module + ":")]
    assert len(found) == 1 and expected in found[0], found


def test_allowed_imports_pass() -> None:
    """A generic model module in the engine, a stage importing the engine and its own layer, and a
    neutral module importing upward (it belongs to no layer) are no violations."""
    found = violations(synthetic_graph())
    for module in ("omni_jax.engine.generic", "omni_jax.stages.down", "omni_jax.neutral"):
        assert not [v for v in found if v.startswith(module + ":")], module


def test_relative_imports_resolve() -> None:
    """``.`` is a module's own package (a package's ``__init__`` is its own); each more dot, one up."""
    assert imports("from . import buckets\n", "omni_jax.engine.x", False) == [("omni_jax.engine.buckets", 1)]
    assert imports("from .. import layers\n", "omni_jax.models.qwen2_5_omni", True) == [
        ("omni_jax.models.layers", 1)
    ]
    dit = "omni_jax.models.qwen2_5_omni.dit"
    assert imports("from ..layers import RMSNorm\n", dit, False) == [("omni_jax.models.layers", 1)]
    assert imports("from ... import jit\n", dit, False) == [("omni_jax.jit", 1)]
