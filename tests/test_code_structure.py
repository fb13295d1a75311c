"""The codebase's own rules, checked: no module reads or writes a private attribute (`_name`) of an object other
than `self` or `cls`, nor imports another module's private name (torch's private operators, which kvloom calls on
purpose, are the listed exceptions); and no import circle between kvloom's modules, lazy imports included."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_PRIVATES = {"torch.ops.mkldnn._reorder_linear_weight", "torch.ops.mkldnn._linear_pointwise", "options._timeout",
                  "torch._scaled_mm"}  # torch's FP8 matmul, as vLLM and torchao call it


def product_modules() -> dict[str, ast.Module]:
    """kvloom's own modules (not its tests), parsed, by dotted name."""
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "tests" or rel.parts[0].startswith("."):
            continue
        name = "kvloom." + ".".join(rel.with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = ast.parse(path.read_text())
    return modules


def private_reach_throughs() -> list[str]:
    found = []
    for module, tree in product_modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvloom"):
                found += [f"{module}: imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if ast.unparse(node) not in TORCH_PRIVATES:
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def import_circles() -> list[list[str]]:
    imports: dict[str, set[str]] = {}
    for module, tree in product_modules().items():
        for node in ast.walk(tree):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            imports.setdefault(module, set()).update(n for n in names if n.startswith("kvloom."))
    circles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(imports.get(module, ())):
            if target in path:
                circles.append(path[path.index(target):] + [target])
            elif (module, target) not in done:
                done.add((module, target))
                visit(target, path + [target])

    for module in sorted(imports):
        visit(module, [module])
    return circles


def test_no_module_touches_another_objects_private_attributes():
    assert private_reach_throughs() == []


def test_no_import_circles_between_kvloom_modules():
    assert import_circles() == []
