"""The package's layering, as docs/architecture.md draws it, checked on the source.

Every `import` of a dagrl module (at the top of a file, inside a function or under
TYPE_CHECKING) goes from a layer to the same layer or a lower one, and no chain of imports
between files comes back to where it started. Device type names appear in dagrl/device.py only.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dagrl"

# Lowest first; a module may import from its own layer and the layers before it.
LAYERS = [
    ["registry", "device", "extras", "file_modes"],
    ["config"],
    ["data"],
    ["dag"],
    ["algorithms"],
    ["observe"],
    ["rewards"],
    ["tools", "envs"],
    ["rollout"],
    ["engines"],
    ["roles"],
    ["runtime"],
    ["cli", "train", "export", "api", "__init__"],
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _top(module: str) -> str:
    """dagrl.engines.actor -> engines; dagrl.device -> device; dagrl -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    """The dagrl modules `path` imports (`from dagrl.x import y` counts as dagrl.x.y when
    that is a module, else dagrl.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "dagrl"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "dagrl":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


FILES = sorted(ROOT.rglob("*.py"))
MODULES = {_module_name(p): p for p in FILES}
GRAPH = {_module_name(p): _imports(p) for p in FILES}


def test_every_package_has_a_layer():
    assert {_top(m) for m in MODULES} <= set(LAYER_OF), sorted({_top(m) for m in MODULES}
                                                               - set(LAYER_OF))


def test_imports_only_go_down_the_layers():
    upward = [f"{m} ({_top(m)}) imports {i} ({_top(i)})"
              for m, imports in GRAPH.items() for i in imports
              if LAYER_OF[_top(i)] > LAYER_OF[_top(m)]]
    assert not upward, "\n".join(upward)


def test_no_import_cycles_between_files():
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH.get(m, ())):
            if n not in MODULES:
                continue
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


# A device type named as a string or reached through torch's per-device modules.
DEVICE_NAMES = re.compile(
    r"""["'](cpu|cuda|npu|gpu|GPU|NPU|mps|xpu)["']|torch\.(cuda|npu|mps|xpu)\b|torch_npu"""
    r"""|\.is_cpu\b|\.is_cuda\b|(CUDA|ASCEND_RT)_VISIBLE_DEVICES""")


@pytest.mark.parametrize("path", [p for p in FILES if p.name != "device.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_device_types_are_named_only_in_device_py(path):
    hits = [f"{path.name}:{i}: {line.strip()}"
            for i, line in enumerate(path.read_text().splitlines(), 1) if DEVICE_NAMES.search(line)]
    assert not hits, "\n".join(hits)
