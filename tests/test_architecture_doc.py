"""docs/ARCHITECTURE.md describes the code as it is: every path and name it quotes exists.

A reader must be able to find every module, record and function the document names, so each
quoted path must be a file or directory of the repository, and each quoted code name must be
defined in it (a class, function, method, attribute, field or module of ``omni_jax`` or
``checkpoints_convert``), or be importable (``jax``, ``flax`` names). The repository must also
stand alone: nothing in it may point to files outside it.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
SOURCES = ("omni_jax", "checkpoints_convert", "benchmarks")
EXTERNAL = ("jax", "flax", "numpy", "transformers", "nnx")
CHECKED_SUFFIXES = (".py", ".md", ".yaml", ".toml", ".txt", ".cfg")

QUOTED = re.compile(r"`([^`\n]+)`")
NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\(\))?$")


@cache
def defined_names() -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """Every name the sources define (modules, classes, functions, attributes, fields, YAML
    stage names), and each class's members."""
    names: set[str] = set()
    members: dict[str, set[str]] = {}
    for package in SOURCES:
        for path in (ROOT / package).rglob("*.py"):
            names.add(path.stem)
            names.update(path.relative_to(ROOT).parent.parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                if isinstance(node, ast.ClassDef):
                    own = members.setdefault(node.name, set())
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            own.add(item.name)
                        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            own.add(item.target.id)
                        elif isinstance(item, ast.Assign):
                            own.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
    for path in (ROOT / "omni_jax" / "stages").glob("*.yaml"):
        names.update(stage["name"] for stage in yaml.safe_load(path.read_text())["stages"])
    for own in members.values():
        names.update(own)
    return frozenset(names), {k: frozenset(v) for k, v in members.items()}


def _importable(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] == "nnx":
        parts = ["flax", "nnx", *parts[1:]]
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def unresolved(text: str) -> list[str]:
    """The quoted paths and code names of ``text`` that name nothing in the repository."""
    names, members = defined_names()
    missing = []
    for quoted in QUOTED.findall(text):
        token = quoted.strip()
        if "/" in token or re.search(r"\.(py|md|yaml|json)$", token):
            path = token.split()[0]
            if not (ROOT / path).exists() and not (ROOT / "omni_jax" / path).exists():
                missing.append(token)
            continue
        if not NAME.match(token):
            continue  # an expression, a shape or a literal: nothing to look up
        dotted = token.removesuffix("()")
        parts = dotted.split(".")
        if parts[0] in EXTERNAL:
            if not _importable(dotted):
                missing.append(token)
        elif len(parts) == 2 and parts[0] in members:
            if parts[1] not in members[parts[0]]:
                missing.append(token)
        elif not all(p in names for p in parts):
            missing.append(token)
    return missing


def test_architecture_doc_names_only_what_exists():
    assert DOC.exists(), "docs/ARCHITECTURE.md is missing"
    missing = unresolved(DOC.read_text())
    assert not missing, f"docs/ARCHITECTURE.md names what the code does not define: {missing}"


@pytest.mark.parametrize(
    "text",
    [
        "`NoSuchRecord`",
        "`ARRunner.no_such_method`",
        "`omni_jax/engine/no_such_module.py`",
        "`jax.no_such_function`",
    ],
)
def test_the_check_catches_a_name_that_does_not_exist(text):
    assert unresolved(text) == [text.strip("`")]


def test_the_check_accepts_names_that_exist():
    text = "`ARRunner.dispatch`, `Scheduler`, `omni_jax/engine/`, `nnx.eval_shape`, `warmup()`"
    assert unresolved(text) == []


def test_readme_links_the_architecture_doc():
    assert "docs/ARCHITECTURE.md" in (ROOT / "README.md").read_text()


def test_nothing_points_outside_the_repository():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in CHECKED_SUFFIXES or name == "tests/test_architecture_doc.py":
            continue
        text = path.read_text()
        if "../shared" in text or "DESIGN.md" in text:
            offenders.append(name)
    assert not offenders, f"files pointing outside the repository (../shared, DESIGN.md): {offenders}"
