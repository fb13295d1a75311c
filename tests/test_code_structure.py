"""The codebase's own rules, checked: no module reads or writes a private attribute (`_name`) of an object other
than `self` or `cls`; torch's private operators, which kvloom calls on purpose, are the listed exceptions."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_PRIVATES = {"torch.ops.mkldnn._reorder_linear_weight", "torch.ops.mkldnn._linear_pointwise", "options._timeout"}


def private_reach_throughs() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv") or rel.parts[0].startswith("."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if ast.unparse(node) not in TORCH_PRIVATES:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_touches_another_objects_private_attributes():
    assert private_reach_throughs() == []
