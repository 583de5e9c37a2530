"""Nothing in the library or the services can turn bytes into code: no pickle (or dill, cloudpickle,
joblib, marshal, shelve), no `torch.load` without `weights_only=True`, no `numpy.load(allow_pickle=True)`,
no non-safe YAML loader, no `eval`/`exec`, no `trust_remote_code=True`. Checked on the syntax tree of every
module (generated protobuf stubs included), so comments and strings that mention these do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
UNSAFE_YAML = {"load", "load_all", "unsafe_load", "unsafe_load_all", "full_load", "full_load_all"}


def _keyword_is(call: ast.Call, name: str, value) -> bool:
    return any(
        k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value for k in call.keywords
    )


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def findings(source: str, where: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            out += [f"{line}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            out.append(f"{line}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in ("eval", "exec"):
                out.append(f"{line}: {name}(...)")
            elif name == "torch.load" and not _keyword_is(node, "weights_only", True):
                out.append(f"{line}: torch.load without weights_only=True")
            elif name in ("np.load", "numpy.load") and _keyword_is(node, "allow_pickle", True):
                out.append(f"{line}: {name}(allow_pickle=True)")
            elif name.startswith("yaml.") and name.split(".", 1)[1] in UNSAFE_YAML:
                out.append(f"{line}: {name} (use yaml.safe_load)")
            elif _keyword_is(node, "trust_remote_code", True):
                out.append(f"{line}: trust_remote_code=True")
    return out


def test_the_checker_catches_each_pattern():
    planted = (
        "import pickle\nfrom dill import loads\neval(x)\nexec(y)\ntorch.load(p)\n"
        "torch.load(p, weights_only=False)\nnp.load(p, allow_pickle=True)\nyaml.load(s)\n"
        "AutoModel.from_pretrained(p, trust_remote_code=True)\n"
    )
    assert len(findings(planted, "planted")) == 9
    harmless = (
        "model.eval()\ntorch.load(p, weights_only=True)\nyaml.safe_load(s)\nnp.load(p)\nre.compile('x')\n"
    )
    assert findings(harmless, "harmless") == []


def test_no_module_can_deserialize_code():
    files = sorted(p for d in ("asyncrlhf", "services") for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 50
    found = [f for p in files for f in findings(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == [], "\n".join(found)
