"""Import hygiene: the operators need torch alone; the runtime does not load the trainer."""
from __future__ import annotations

import subprocess
import sys

import pytest


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    return set(out.split())


def test_kernels_import_without_transformers():
    loaded = _modules_after("import specdec.kernels, specdec.kernels.reference; specdec.kernels.has_native('tree_attention')")
    assert "specdec.kernels" in loaded
    assert "transformers" not in loaded
    assert not any(m.startswith("specdec.") and m.split(".")[1] not in ("kernels", "_C") for m in loaded), \
        sorted(m for m in loaded if m.startswith("specdec."))


def test_top_level_is_lazy():
    loaded = _modules_after("import specdec; assert specdec.__version__")
    assert "transformers" not in loaded and "specdec.api" not in loaded
    loaded = _modules_after("import specdec; specdec.SpecDecoder")
    assert "specdec.api" in loaded


def test_runtime_does_not_import_the_trainer():
    loaded = _modules_after("import specdec.api, specdec.bench, specdec.cli, specdec.hub")
    assert not any(m.startswith("specdec.distill") for m in loaded), sorted(m for m in loaded if "distill" in m)


def test_drafters_do_not_import_policies_or_the_api():
    loaded = _modules_after("import specdec.drafters, specdec.drafters.feature_draft")
    assert not any(m.startswith(("specdec.policies", "specdec.api", "specdec.methods", "specdec.decoding"))
                   for m in loaded), sorted(m for m in loaded if m.startswith("specdec."))


def test_policies_do_not_import_drafters():
    """The contract between drafting and planning lives below both (specdec.contracts)."""
    loaded = _modules_after("import specdec.policies, specdec.policies.disco, specdec.policies.batch_length")
    assert not any(m.startswith(("specdec.drafters", "specdec.api", "specdec.methods", "specdec.decoding"))
                   for m in loaded), sorted(m for m in loaded if m.startswith("specdec."))


def test_registrations_are_explicit():
    code = ("from transformers import AttentionInterface, AutoConfig\n"
            "import specdec.api, specdec.model\n"
            "assert 'specdec' not in AttentionInterface._global_mapping\n"
            "try:\n    AutoConfig.for_model('specdec_eagle')\nexcept ValueError:\n    pass\n"
            "else:\n    raise AssertionError('draft classes registered on import')\n"
            "from specdec.model import register_attention\n"
            "register_attention()\n"
            "assert 'specdec' in AttentionInterface._global_mapping\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# Reads of another object's private attribute that are not specdec's business: the same class's own factory,
# and torch's compiled-function record (a library object whose field shares a name with one of ours).
_FOREIGN_PRIVATE = {("specdec/distill/corpus.py", "_save_manifest"), ("specdec/precompile.py", "_artifacts")}


def test_modules_use_each_other_through_public_names():
    """Composition by contract: no specdec module reads or writes another object's private members (GSD and
    Ouroboros call the draft model's public component, PEARL's worker its rollback) or imports another module's
    private names (PEARL's loop is built from decoding's public step pieces), so a private name can change
    inside its own module."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    trees = {p.relative_to(root).as_posix(): ast.parse(p.read_text()) for p in (root / "specdec").rglob("*.py")}
    ours = set()  # private names specdec defines: methods, functions, and attributes set on self
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("_"):
                ours.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                ours.add(n.attr)
    found = []
    for path, tree in trees.items():
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
                continue
            if n.attr not in ours or (path, n.attr) in _FOREIGN_PRIVATE:
                continue
            v = n.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            found.append(f"{path}:{n.lineno}: {ast.unparse(n)}")
        for n in ast.walk(tree):  # nor imports another module's private names
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("specdec"):
                found += [f"{path}:{n.lineno}: from {n.module} import {a.name}" for a in n.names
                          if a.name.startswith("_") and not a.name.startswith("__") and a.name not in ("_C", "_fake")]
    assert not found, "\n".join(found)


def test_environment_switches_are_declared_in_one_place():
    """Every SPECDEC_* variable a module reads is declared in specdec.settings, and only the kernels package
    (importable with torch alone) reads one without going through settings.get."""
    import pathlib
    import re

    from specdec import settings

    root = pathlib.Path(__file__).resolve().parents[1] / "specdec"
    direct, named = [], set()
    for p in root.rglob("*.py"):
        text = p.read_text()
        named |= set(re.findall(r"\bSPECDEC_[A-Z0-9_]+\b", text))
        rel = p.relative_to(root).as_posix()
        for m in re.finditer(r"os\.environ(?:\.get\(|\[)\s*\"(SPECDEC_[A-Z0-9_]+)", text):
            if not rel.startswith("kernels/"):
                direct.append(f"{rel}: {m.group(1)}")
    assert not direct, direct
    for p in (root.parent / "csrc").rglob("*.cpp"):  # the extension reads its own switches with getenv
        named |= set(re.findall(r"getenv\(\"(SPECDEC_[A-Z0-9_]+)", p.read_text()))
    assert "SPECDEC_ATTENTION_DIRECT_ROWS" in named
    assert named <= set(settings.SWITCHES), sorted(named - set(settings.SWITCHES))
    assert set(settings.GRAPH_SWITCHES) <= set(settings.SWITCHES)
    with pytest.raises(KeyError, match="not a declared"):
        settings.get("SPECDEC_NOT_A_SWITCH")
