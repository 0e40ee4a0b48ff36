"""The components section: each one a checkpoint (``path``) or declared sizes (``size``)."""

from __future__ import annotations

import os
import re
from typing import Any

from .model import DTYPES, LOAD_MODES, OFFLOAD_MODES, ComponentConfig
from .source import ConfigOrigin, Section, resolve_path

__all__ = ["parse_components"]

# A declared layer count beyond this is a typo: DiTs have tens to hundreds of blocks,
# and the planners walk every layer.
_MAX_LAYERS = 10_000

_COMPONENT_KEYS = (
    "path", "offload", "layers", "prefetch", "size", "lora_targets", "dtype", "variant", "load", "steps",
)


def _component(origin: ConfigOrigin, name: str, data: Any) -> ComponentConfig:
    s = Section(origin, f"components.{name}", data, _COMPONENT_KEYS)
    offload = s.choice("offload", OFFLOAD_MODES, None)
    if s.has("path") == s.has("size"):
        raise origin.error(
            s.key, "give either path (a checkpoint) or size (declared sizes, to plan without the weights)"
        )
    path = resolve_path(origin, s.sub("path"), s.get("path")) if s.has("path") else None
    if path is not None and not os.path.exists(path):
        raise origin.error(
            s.sub("path"),
            f"{path} does not exist; fix the path (relative paths start at the config's folder), "
            "write the checkpoint first, or declare size/layers instead",
        )
    if path is not None and not (os.path.isfile(path) or os.path.isdir(path)):
        raise origin.error(s.sub("path"), f"{path} is not a regular file or folder (a FIFO, socket or device); name "
                           "the checkpoint's .safetensors file or its folder")
    pattern, count = _layers(s, offload, declared=path is None)
    target_bytes, target_patterns = _lora_targets(s, declared=path is None)
    size = s.size("size")
    if s.has("prefetch") and offload != "layerwise":
        raise origin.error(s.sub("prefetch"), f"is the read-ahead window of a streamed component (offload: layerwise); "
                           f"a component with offload {offload} moves whole: remove prefetch, or stream it")
    if s.has("steps") and offload != "layerwise":
        raise origin.error(s.sub("steps"), "only a streamed component (offload: layerwise) runs a share of the steps; "
                           "remove steps, or stream it")
    if size is not None and size < max(1, count or 1):  # no weights, or blocks of no bytes: a plan of nothing
        raise origin.error(s.sub("size"), f"{s.get('size')!r} over {count or 1} block(s) leaves a block no bytes; "
                                          "give the component's weights' size (e.g. 24GB)")
    if size is not None and target_bytes is not None and target_bytes > size:
        raise origin.error(s.sub("lora_targets"), f"{s.get('lora_targets')!r} exceeds size {s.get('size')!r}")
    return ComponentConfig(
        name=name,
        offload=offload,
        path=path,
        layer_pattern=pattern,
        layer_count=count,
        size=size,
        lora_target_bytes=target_bytes,
        lora_target_patterns=target_patterns,
        dtype=s.choice("dtype", DTYPES, None) if s.has("dtype") else None,
        variant=_variant(s, path),
        load=s.choice("load", LOAD_MODES, "mapped"),
        prefetch=s.integer("prefetch", 1, 0, maximum=_MAX_LAYERS),
        steps=s.integer("steps", None, 1, maximum=10_000),
    )


def _variant(s: Section, path: str | None) -> str | None:
    """``variant``: which weights of a diffusers folder the server loads (``fp16`` for
    ``diffusion_pytorch_model.fp16.safetensors``), as ``from_pretrained(variant=...)``."""
    value = s.get("variant")
    if value is None:
        return None
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_]+", value):
        raise s.origin.error(s.sub("variant"), f"{value!r} is not a variant name; write one such as fp16 or bf16")
    if path is None or not os.path.isdir(path):
        raise s.origin.error(s.sub("variant"), "a variant names files of a checkpoint folder; give path a folder, "
                             "or remove variant")
    return value


def _layers(s: Section, offload: str, declared: bool) -> tuple[str | tuple[str, ...] | None, int | None]:
    """``layers`` names the blocks: with a checkpoint a pattern (``"blocks.{i}."``) or a list of
    them (Flux's ``transformer_blocks.{i}.`` and ``single_transformer_blocks.{i}.``), declared a count."""
    value = s.get("layers")
    if value is None:
        if offload == "layerwise":
            need = "a count such as 208" if declared else 'a pattern such as "blocks.{i}."'
            raise s.origin.error(s.sub("layers"), f"missing; a layerwise component needs {need}")
        return None, None
    if declared:
        return None, s.integer("layers", None, 1, maximum=_MAX_LAYERS)
    patterns = value if isinstance(value, list) and value else [value]
    for pattern in patterns:
        if not isinstance(pattern, str) or pattern.count("{i}") != 1:
            raise s.origin.error(
                s.sub("layers"), f"{pattern!r} is not a block pattern; write one with a single {{i}}, e.g. "
                "\"blocks.{i}.\", or a list of them, e.g. "
                "[\"transformer_blocks.{i}.\", \"single_transformer_blocks.{i}.\"]"
            )
    if len(set(patterns)) != len(patterns):
        raise s.origin.error(s.sub("layers"), f"{value!r} lists a pattern twice; list each once")
    return (value if isinstance(value, str) else tuple(value)), None


def _lora_targets(s: Section, declared: bool) -> tuple[int | None, tuple[str, ...]]:
    """A size (bytes of merged weights) or, with a checkpoint, glob patterns of tensor names."""
    value = s.get("lora_targets")
    if value is None:
        return None, ()
    if isinstance(value, list):
        if declared or not value or not all(isinstance(v, str) and v for v in value):
            need = "a size (declared components have no tensor names)" if declared else "non-empty name patterns"
            raise s.origin.error(s.sub("lora_targets"), f"expected {need}, e.g. 38GB or [\"*.attn.*.weight\"]")
        return None, tuple(value)
    return s.size("lora_targets"), ()


def check_experts(origin: ConfigOrigin, components: dict[str, ComponentConfig], steps: int) -> None:
    """Experts that alternate (each with ``steps``: Wan 2.2's high- and low-noise DiTs)
    split the request's ``workload.steps`` between them at a boundary step: their
    steps must add up to it, or the plan would move weights no request moves."""
    experts = [c for c in components.values() if c.steps is not None]
    if not experts:
        return
    if len(experts) == 1:
        raise origin.error(
            f"components.{experts[0].name}.steps",
            "only one component runs a share of the steps; name the experts that take turns (each with steps, "
            "adding up to workload.steps), or remove steps to run it every step",
        )
    total = sum(c.steps for c in experts)
    if total != steps:
        named = " + ".join(f"{c.name} {c.steps}" for c in experts)
        raise origin.error(
            f"components.{experts[-1].name}.steps",
            f"the experts' steps ({named} = {total}) do not add up to workload.steps ({steps}); each request "
            "runs every step on exactly one expert, so split the steps at the boundary step",
        )


def parse_components(origin: ConfigOrigin, data: Any) -> dict[str, ComponentConfig]:
    if not isinstance(data, dict) or not data:
        raise origin.error("components", "missing or empty; name at least one component (dit, text_encoder, ...)")
    out = {}
    for name, body in data.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", name):
            raise origin.error(f"components.{name}", "a component name is a word such as dit or text_encoder")
        out[name] = _component(origin, name, body)
    return out
