"""Which checkpoint weights a set of adapters changes, read from headers alone (no torch).

A plan needs the names of the weights a merge will write, and their bytes, not the
adapter's values. For the common layouts (peft and diffusers ``lora_A/B``, kohya
``lora_unet_``, ComfyUI and lightx2v ``diffusion_model.``) the adapter's safetensors
header says it all: each key splits into a stem and a part (:func:`lora_cache.adapters.formats.split_key`, the formats' one suffix table),
each stem names a module by the resolver the merge uses (:func:`lora_cache.adapters.key_names.resolve_stem`),
and the parts' shapes say which weight or bias changes and whether it fits.

A folder a trainer wrote names its file as it does for the reader
(:mod:`lora_cache.adapters.paths`); peft's ``adapter_config.json`` changes no name (its
ranks and alphas scale values), so it is only read to see that it parses and asks for
neither DoRA nor saved modules. Anything this reading cannot decide as the full reader
would is handed back with the reason (:class:`NeedsReader`), and the caller reads the
file with torch: a config with DoRA or saved modules, a part this module does not know,
a malformed or unmatched key, a rule that places a change on rows of a fused weight,
two keys on one module. So the fast path never gives other names than the merge would;
at worst it is not taken. Values are not read here: NaN checks, ranks against peft's
config and alpha conflicts are the merge's, before it writes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable

from hostmem.errors import HostmemError
from hostmem.safetensors.header import SafetensorsError, read_header

from ..adapters.paths import adapter_file_in, peft_config_path
from ..adapters.formats import loha, lokr, split_key
from ..adapters.key_names import KeyResolutionError, KeyRule, ModuleIndex, resolve_stem

__all__ = ["NeedsReader", "adapter_path_rules", "header_targets", "listed_adapters", "tensor_targets"]

_FLOATS = ("F16", "BF16", "F32", "F64")
_FACTORED = (*loha.PARTS, *lokr.PARTS, "mid")  # lora_cache.adapters.lycoris_parts.ROLES, without its imports


class NeedsReader(HostmemError):
    """This adapter needs the full (torch) reader; the message says why. Not an error
    for the user: the caller reads the file with the reader, which refuses what is wrong."""


def header_targets(adapters: Iterable, shapes: dict[str, tuple[int, ...]]) -> tuple[str, ...]:
    """The checkpoint's parameter names the adapters change, in the checkpoint's order.

    ``adapters``: paths, ``(path, strength)`` tuples or config dicts (what
    :func:`lora_cache.as_adapters` takes, less ``Adapter`` objects, whose owner has torch
    already); ``shapes``: ``{parameter name: shape}`` from the checkpoint's headers.
    Raises :class:`NeedsReader` where only the full reader can tell.
    """
    index, changed = ModuleIndex(shapes), set()
    for path, rules in (adapter_path_rules(a) for a in listed_adapters(adapters)):
        changed.update(_file_params(path, _stems(path), rules, index))
    return tuple(name for name in shapes if name in changed)


def tensor_targets(path: str, tensors: dict, rules: list[KeyRule], shapes: dict[str, tuple[int, ...]]) -> tuple[str, ...]:
    """The parameters one adapter's ``tensors`` (``{key: info with .shape and .dtype}``,
    safetensors' dtype names) change, in the checkpoint's order: the header reading applied
    to keys that come from elsewhere than ``path``'s header (a conversion record).
    Raises :class:`NeedsReader` where only the full reader can tell."""
    changed = set(_file_params(path, _split(path, tensors), rules, ModuleIndex(shapes)))
    return tuple(name for name in shapes if name in changed)


def _file_params(path: str, stems: dict, rules: list[KeyRule], index: ModuleIndex) -> list[str]:
    """The parameters one file's stems change; two stems on one module go to the reader."""
    owners: dict[str, str] = {}
    params: list[str] = []
    for stem, parts in stems.items():
        module = _module(path, stem, rules, index)
        if module in owners:
            raise NeedsReader(f"{path}: {owners[module]!r} and {stem!r} both name {module!r}")
        owners[module] = stem
        params += _changed_params(path, stem, module, parts, index)
    return params


def listed_adapters(adapters) -> list:
    """The adapters given, as a list (one path, tuple or dict alone is one adapter)."""
    one = isinstance(adapters, (str, os.PathLike, dict)) or (
        isinstance(adapters, tuple) and len(adapters) == 2 and isinstance(adapters[0], (str, os.PathLike))
        and isinstance(adapters[1], (int, float)))
    return [adapters] if one else list(adapters)


def adapter_path_rules(adapter) -> tuple[str, list[KeyRule]]:
    """``(path, rules)`` of one adapter as given (an unmatched key goes to the reader, strict or not)."""
    if isinstance(adapter, (str, os.PathLike)):
        return os.fspath(adapter), []
    if isinstance(adapter, tuple) and len(adapter) == 2:
        return os.fspath(adapter[0]), []
    if isinstance(adapter, dict) and "path" in adapter:
        try:
            return os.fspath(adapter["path"]), [KeyRule.parse(r) for r in adapter.get("rules") or ()]
        except KeyResolutionError as exc:
            raise NeedsReader(f"{adapter['path']}: {exc}") from None
    raise NeedsReader(f"adapter {adapter!r}: given as an object; its reader checks it")


def _stems(given: str) -> dict[str, dict]:
    """``{stem: {role: TensorInfo}}`` of the header of the adapter file ``given`` names."""
    path, why = adapter_file_in(given)
    if path is None:
        raise NeedsReader(why)
    _check_peft_config(path)
    try:
        tensors = read_header(path).tensors
    except (SafetensorsError, OSError) as exc:
        raise NeedsReader(f"{path}: {exc}") from None
    return _split(path, tensors)


def _split(path: str, tensors: dict) -> dict[str, dict]:
    """``{stem: {role: info}}`` of a file's tensors, by the formats' one suffix table."""
    if not tensors:
        raise NeedsReader(f"{path}: no tensors")
    stems: dict[str, dict] = {}
    for key, info in tensors.items():
        split = split_key(key)
        if split is None or split[1] in stems.get(split[0], {}):
            raise NeedsReader(f"{path}: key {key!r} is no part this reading knows")
        stems.setdefault(split[0], {})[split[1]] = info
    return stems


def _check_peft_config(path: str) -> None:
    """peft's config beside its file changes no name, but DoRA and saved modules do what
    only the reader checks; a config that does not parse goes to the reader too."""
    config = peft_config_path(path)
    if config is None:
        return
    try:
        with open(config, encoding="utf-8") as handle:
            raw = json.load(handle)
    except (OSError, ValueError) as exc:
        raise NeedsReader(f"{config}: {exc}") from None
    if not isinstance(raw, dict) or raw.get("use_dora") or raw.get("modules_to_save"):
        raise NeedsReader(f"{config}: DoRA or modules_to_save, which the reader checks")


def _module(path: str, stem: str, rules: list[KeyRule], index: ModuleIndex) -> str:
    """The one module a stem names, whole (rows of a fused weight go to the full reader)."""
    try:
        targets = resolve_stem(stem, rules, index)
    except KeyResolutionError as exc:
        raise NeedsReader(f"{path}: {stem!r} {exc}") from None
    if targets is None:
        raise NeedsReader(f"{path}: {stem!r} names no module of the model")
    if len(targets) != 1 or targets[0].rows is not None or targets[0].part is not None:
        raise NeedsReader(f"{path}: {stem!r} is placed on rows of a fused weight")
    return targets[0].module


def _changed_params(path: str, stem: str, module: str, parts: dict, index: ModuleIndex) -> list[str]:
    """The parameters of ``module`` a stem's parts change, each checked to fit as the merge checks it."""
    if any(role in parts for role in _FACTORED):
        raise NeedsReader(f"{path}: {stem!r} is a LyCORIS LoHa, LoKr or Tucker LoCon, whose factors the reader places")
    up, down = parts.get("up"), parts.get("down")
    if (up is None) != (down is None) or (up is None and ("up_b" in parts or "magnitude" in parts)):
        raise NeedsReader(f"{path}: {stem!r} lacks a matrix of its pair")
    if any(info.dtype not in _FLOATS for role, info in parts.items() if role != "alpha"):
        raise NeedsReader(f"{path}: {stem!r} has a part that is not floating point")
    if "alpha" in parts and math.prod(parts["alpha"].shape) != 1:
        raise NeedsReader(f"{path}: {stem!r} has an alpha of more than one value")
    weight = None
    if up is not None:
        weight = _product_shape(path, stem, up.shape, down.shape, parts.get("magnitude"))
    elif "diff" in parts:
        weight = parts["diff"].shape
    elif "diff_b" not in parts:
        raise NeedsReader(f"{path}: {stem!r} has neither a LoRA pair nor a diff")
    changed = [] if weight is None else [(f"{module}.weight", weight)]
    changed += [(f"{module}.bias", parts[r].shape) for r in ("diff_b", "up_b") if r in parts]
    for param, shape in changed:
        if param not in index.shapes or tuple(index.shapes[param]) != tuple(shape):
            raise NeedsReader(f"{path}: {stem!r} does not fit {param!r}")
    return [param for param, _ in changed]


def _product_shape(path: str, stem: str, up: tuple, down: tuple, magnitude) -> tuple[int, ...]:
    """The shape of ``up @ down`` (linear, or a 1-D, 2-D or 3-D conv with a 1x1 up kernel)."""
    fits = (len(up) in (2, 3, 4, 5) and len(down) in (2, 3, 4, 5) and down[0] > 0 and up[1] == down[0]
            and all(k == 1 for k in up[2:]))
    if fits and magnitude is not None and math.prod(magnitude.shape) != up[0]:
        fits = False
    if not fits:
        raise NeedsReader(f"{path}: {stem!r} has factors that do not multiply as a LoRA pair")
    return (up[0], *down[1:])

