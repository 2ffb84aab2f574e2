"""The package's structure: each layer imports only the layers below it (so no package has an
import cycle), and no module of the engine or the KV layer is over 450 lines (the ``LLM`` facade
at most 200)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "xoffload"

#: each package and the packages it may import (docs/DESIGN.md, "Layers")
ALLOWED = {
    "kernels": set(),
    "runtime": {"kernels"},
    "sparse": {"kernels"},
    "testing": {"kernels"},
    "models": {"kernels", "runtime", "sparse"},
    "kv": {"kernels", "runtime", "sparse", "models"},
    "engine": {"kernels", "runtime", "sparse", "models", "kv"},
    "evals": {"kernels", "runtime", "sparse", "models", "kv", "engine", "testing"},
    "serve": {"kernels", "runtime", "sparse", "models", "kv", "engine"},
    "integrations": {"kernels", "runtime", "sparse", "models", "kv", "engine"},
}


def _imports(path: pathlib.Path, package: str):
    """Top-level xoffload packages ``path`` imports (relative and absolute, lazy ones included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    rel = path.relative_to(ROOT).parts
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel[:-1])[: len(rel) - node.level]
                parts = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.startswith("xoffload."):
                parts = node.module.split(".")[1:]
            else:
                continue
            if parts:
                yield parts[0], node.lineno
            elif node.level:  # "from .. import x": x is a package
                for a in node.names:
                    yield a.name, node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("xoffload."):
                    yield a.name.split(".")[1], node.lineno


def test_each_layer_imports_only_the_layers_below():
    bad = []
    for pkg, allowed in ALLOWED.items():
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for dep, line in _imports(path, pkg):
                if dep != pkg and (ROOT / dep).is_dir() and dep not in allowed:
                    bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports xoffload.{dep}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_engine_and_kv_modules_are_small():
    long = []
    for pkg in ("engine", "kv"):
        for path in sorted((ROOT / pkg).glob("*.py")):
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > 450:
                long.append(f"{path.relative_to(ROOT.parent)}: {n} lines")
    facade = len((ROOT / "engine" / "llm.py").read_text(encoding="utf-8").splitlines())
    assert not long, "modules over 450 lines:\n" + "\n".join(long)
    assert facade <= 200, f"the LLM facade has {facade} lines"
