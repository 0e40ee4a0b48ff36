"""Which weights a model class keeps in fp32 when it is loaded in another dtype.

``from_pretrained(torch_dtype=...)`` casts every floating weight but those of the modules
its class names in ``_keep_in_fp32_modules``: diffusers keeps them in fp32 whatever dtype
is asked for (Wan's ``time_embedder``, ``norm1``...; a parameter is kept when one of its
dotted name's parts is such a module), transformers only for fp16 (T5's ``wo``: a third
of the encoder's weights; the name matched anywhere in the parameter's name), and for
fp16 and bf16 those in ``_keep_in_fp32_modules_strict``. A plan that counted them at the
served dtype would under-count the host's copies (a bf16 T5 served as fp16 holds its
``wo`` as fp32 copies, twice the size planned).

The class is read, not imported: importing diffusers or transformers takes seconds a plan
does not have. The class named by the checkpoint's ``config.json`` (diffusers'
``_class_name``; transformers' ``architectures`` and ``model_type``) is found in the
installed library's source and its class attributes read with :mod:`ast` (through its
bases in the same file). Where the library is not installed, the class not found or the
attribute not a literal, nothing is kept: the plan counts every weight cast, as before.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re

__all__ = ["KeptInFp32", "kept_in_fp32"]


class KeptInFp32:
    """The modules kept in fp32 at one served dtype, and the library's rule for matching them."""

    def __init__(self, modules: tuple[str, ...], library: str):
        self.modules, self.library = modules, library

    def __bool__(self) -> bool:
        return bool(self.modules)

    def keeps(self, name: str) -> bool:
        """Whether the parameter ``name`` stays in fp32."""
        if self.library == "diffusers":
            parts = name.split(".")
            return any(m in parts for m in self.modules)
        return any(re.search(m.replace("*", ".*"), name) for m in self.modules)


NONE = KeptInFp32((), "")


def kept_in_fp32(config: dict | None, dtype: str | None) -> KeptInFp32:
    """The modules the class ``config`` (a checkpoint's ``config.json``) names keeps in fp32
    when served as ``dtype`` (``bf16``, ``fp16``, ``fp32``...; None: as stored, nothing cast)."""
    if not isinstance(config, dict) or dtype in (None, "fp32"):
        return NONE
    name = config.get("_class_name")
    if isinstance(name, str) and name.isidentifier():
        attrs = _class_attributes("diffusers", "models", name)
        return KeptInFp32(_names(attrs.get("_keep_in_fp32_modules")), "diffusers")
    archs, model_type = config.get("architectures"), config.get("model_type")
    if isinstance(archs, list) and archs and isinstance(archs[0], str) and isinstance(model_type, str):
        folder = model_type.replace("-", "_")
        attrs = _class_attributes("transformers", os.path.join("models", folder), archs[0])
        kept = _names(attrs.get("_keep_in_fp32_modules_strict")) if dtype in ("fp16", "bf16") else ()
        if dtype == "fp16":
            kept += _names(attrs.get("_keep_in_fp32_modules"))
        return KeptInFp32(tuple(dict.fromkeys(kept)), "transformers")
    return NONE


def _names(value) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, str) for v in value):
        return tuple(sorted(value) if isinstance(value, (set, frozenset)) else value)
    return ()


@functools.lru_cache(maxsize=64)
def _class_attributes(library: str, under: str, name: str) -> dict:
    """The literal class attributes of class ``name`` defined in ``library``'s source under
    ``under``, its bases in the same file first (empty: not installed, not found)."""
    try:
        spec = importlib.util.find_spec(library)
    except (ImportError, ValueError):
        return {}
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    needle = f"class {name}(".encode()
    for location in locations:
        for folder, _, files in os.walk(os.path.join(location, under)):
            for file in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, file)
                try:
                    with open(path, "rb") as handle:
                        source = handle.read()
                except OSError:
                    continue
                if needle in source:
                    return _attributes_in(source, name)
    return {}


def _attributes_in(source: bytes, name: str) -> dict:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return {}
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    found: dict = {}

    def gather(cls: ast.ClassDef, depth: int) -> None:
        if depth > 16:
            return
        for base in reversed(cls.bases):  # the first base wins, as in the class's MRO
            if isinstance(base, ast.Name) and base.id in classes:
                gather(classes[base.id], depth + 1)
        for node in cls.body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
            for target in targets:
                if isinstance(target, ast.Name):
                    try:
                        found[target.id] = ast.literal_eval(node.value)
                    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                        found.pop(target.id, None)

    if name in classes:
        gather(classes[name], 0)
    return found
