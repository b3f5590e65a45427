"""Structure rules of the package that keep new kernel families cheap to add (CPU, no build).

* No import cycle anywhere in ``flashtile/`` (module-level imports; imports inside functions
  are deliberate lazy imports and do not count).
* Kernel builders never index tensors with dense (batch, seq, ...) offsets themselves: every
  tile slice goes through ``seqinfo.Sequence`` so that packed and dense batches share them.
* Launch-time decisions live in ``kernels/launch.py``; builder modules only build.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "flashtile"
BUILDERS = ["fwd.py", "fwd_ws.py", "bwd.py", "bwd_ws.py", "pipeline.py", "softmax.py", "masks.py"]


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _top_level_imports(path: pathlib.Path) -> set[str]:
    """Modules of the package imported at module level (not inside functions)."""
    tree = ast.parse(path.read_text())
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("flashtile"):
                continue
            for alias in node.names:  # `from . import x` may name a submodule
                sub = f"{mod}.{alias.name}"
                found.add(sub if (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists() else mod)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("flashtile"))
    found.discard(name)
    return found


def test_no_import_cycles():
    graph = {_module_name(p): _top_level_imports(p) for p in ROOT.rglob("*.py")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(mod: str) -> None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(graph.get(mod, ())):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod)


# A tensor indexed with a bare batch index in dim 0, e.g. Q[b, m0 : m0 + block_m, h, :] or
# LSE[b, h, ...]: the dense layout written into a builder.
DENSE_INDEX = re.compile(r"\b(Q|K|V|O|dO|dQ|dK|dV|dQacc|LSE|LSE2|Delta)\[b, ")


@pytest.mark.parametrize("name", BUILDERS)
def test_builders_have_no_dense_offsets(name):
    src = (ROOT / "kernels" / name).read_text()
    hits = [line.strip() for line in src.splitlines() if DENSE_INDEX.search(line)]
    assert not hits, f"kernels/{name} indexes tensors densely (use seqinfo.Sequence): {hits[:3]}"


@pytest.mark.parametrize("name", BUILDERS)
def test_builders_do_not_launch(name):
    src = (ROOT / "kernels" / name).read_text()
    for word in ("def launch_", "def get_forward_kernel", "def get_backward_kernels", "torch.cuda"):
        assert word not in src, f"kernels/{name}: {word!r} belongs in kernels/launch.py or kernels/target.py"


def test_no_module_named_ring_in_kernels():
    """``ring`` means ring attention (``flashtile.distributed``); the kernels' K/V loader is
    ``kernels/pipeline.py``."""
    assert not (ROOT / "kernels" / "ring.py").exists()
