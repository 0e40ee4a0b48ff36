"""Reading an adapter file (or the folder a trainer wrote) into :class:`ModuleChange` records.

Every format names the same few parts of a module's change with its own suffixes; each
format is a module of :mod:`lora_cache.adapters.formats`, tried from one list there.
:func:`read_adapter` reads a file with the first that claims it, which strips the
suffixes and groups the parts by key stem. Which model module a
stem names is decided in :mod:`lora_cache.targets.keys`. Tensors stay views of a read-only
mapping of the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hostmem.safetensors.mapping import SafetensorsError, open_readonly

from .paths import adapter_file_in, peft_config_path
from .alpha import AlphaSources, PeftConfig, diffusers_metadata, header_alpha, peft_config_from
from . import read_stamps
from .checks import FiniteCheck, check_change
from .formats import Reading, detect, known_parts, split_key
from .formats.refused import refuse
from .spec import AdapterError

__all__ = ["AdapterFile", "ModuleChange", "build_adapter_file", "open_adapter", "peft_config_path", "read_adapter",
           "read_opened", "reading_of", "resolve_file"]

@dataclass
class ModuleChange:
    """One module's change in an adapter file, under the file's own key stem."""

    stem: str
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # role -> tensor
    keys: dict[str, str] = field(default_factory=dict)  # role -> key in the file

    @property
    def rank(self) -> int | None:
        down = self.parts.get("down")
        return None if down is None else int(down.shape[0])

    @property
    def stored_alpha(self) -> float | None:
        alpha = self.parts.get("alpha")
        return None if alpha is None else float(alpha.float().reshape(-1)[0])


@dataclass
class AdapterFile:
    """An adapter file read into :class:`ModuleChange` records, by key stem.

    ``config`` is peft's ``adapter_config.json`` beside the file; ``sources`` every place
    the file states alphas (see :mod:`lora_cache.adapters.alpha`); ``folded``: the
    converter already folded every module's alpha into its factors (an override given
    to it included), so no alpha applies afterwards; ``converter`` names
    the converter that produced ``modules`` when it was not this package's reader;
    ``values_check`` refuses NaN and infinite values in the file, run before the values
    are first consumed (see :mod:`lora_cache.adapters.checks`); ``rules`` are key rules
    the reader adds after the user's (a format's module names, see
    :mod:`lora_cache.adapters.formats.kohya_flux`), named in the key by ``converter``.
    """

    path: str
    format: str
    modules: dict[str, ModuleChange]
    config: PeftConfig | None = None
    sources: AlphaSources | None = None
    converter: str | None = None
    values_check: Callable[[], None] | None = None  # a FiniteCheck, or NoValues for a record's skeleton
    rules: tuple = ()
    folded: bool = False

    def __post_init__(self):
        if self.sources is None:
            self.sources = AlphaSources(self.path, peft=self.config)

    def alpha(self, change: ModuleChange, override: float | None = None) -> float | None:
        """The alpha a module is scaled by: ``override`` (``Adapter(alpha=...)``) where it
        was not folded into the factors already, else the file's, by the precedence of
        :mod:`~lora_cache.adapters.alpha`; None is alpha = rank."""
        return self.alpha_from(change, override)[0]

    def alpha_from(self, change: ModuleChange, override: float | None = None) -> tuple[float | None, str]:
        """``(alpha, where it was read from)`` for a module (see :meth:`alpha`): what the
        canonical form records as the origin of a scale."""
        if self.folded:  # alpha / rank is in the factors: the file's alphas, or the override, once
            return None, f"folded into the factors by {self.converter}" + (" (the override)" if override else "")
        if override is not None:
            return override, "Adapter(alpha=...)"
        stored = None if change.stored_alpha is None else (change.keys["alpha"], change.stored_alpha)
        return self.sources.resolve(change.stem, stored)

    def rank(self, change: ModuleChange) -> int | None:
        """The module's rank (the down matrix's rows), checked against the configs."""
        rank = change.rank
        if rank is not None:
            self.sources.check_rank(change.stem, change.keys["down"], rank)
        return rank

    def rslora_for(self, change: ModuleChange) -> bool:
        return self.sources.rslora(change.stem)

    @property
    def key_extras(self) -> dict:
        """Inputs of the merged bytes beyond the file's content (the converter, when one ran)."""
        return {} if self.converter is None else {"converter": self.converter}


def _read_peft_config(file: str, tensors: dict) -> PeftConfig | None:
    path = peft_config_path(file)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{path}: cannot read the adapter config ({exc})") from None
    config = peft_config_from(path, raw)
    _refuse_saved_modules(file, tensors, raw.get("modules_to_save") or [])
    return config


def _refuse_saved_modules(path: str, tensors: dict, saved: list) -> None:
    """peft's ``modules_to_save`` are stored whole: their trained weights replace the
    model's, which is no change a merge adds (and no key of a LoRA part)."""
    names = [str(n) for n in saved]
    found = sorted(key for key in tensors if key.endswith((".weight", ".bias")) and split_key(key) is None
                   and any(key.rpartition(".")[0].endswith(n) for n in names))
    if found:
        raise AdapterError(
            f"{path}: {len(found)} key(s) hold peft modules_to_save ({', '.join(found[:3])}"
            f"{', ...' if len(found) > 3 else ''}): whole trained modules that replace the model's, which lora_cache "
            "does not merge (it adds changes to the model's weights). Merge this adapter with peft's "
            "merge_and_unload, or train it without modules_to_save"
        )


def resolve_file(path: str) -> str:
    """The adapter file a path names: itself, or the file the trainer wrote into a folder."""
    found, why = adapter_file_in(path)
    if found is None:
        raise AdapterError(why)
    return found


def group_parts(path: str, tensors: dict[str, torch.Tensor]) -> dict[str, ModuleChange]:
    """Group ``tensors`` by key stem; every key must be a LoRA part this merge understands."""
    modules: dict[str, ModuleChange] = {}
    for key in sorted(tensors):
        refuse(path, key)
        split = split_key(key)
        if split is None:
            raise AdapterError(f"{path}: key {key!r} is not a LoRA part this merge understands ({known_parts()})")
        stem, role = split
        change = modules.setdefault(stem, ModuleChange(stem))
        if role in change.parts:  # two spellings of one part (lora_down and lora_A): neither is dropped unsaid
            raise AdapterError(
                f"{path}: keys {change.keys[role]!r} and {key!r} are both the {role!r} part of module {stem!r}; "
                "a file joined from two adapters holds two LoRAs of one module under one name. Keep one of "
                "them in the file, or save each adapter to a file of its own and give both"
            )
        change.parts[role] = tensors[key]
        change.keys[role] = key
    for change in modules.values():
        check_change(path, change.parts, change.keys)
    return modules


def build_adapter_file(path: str, tensors: dict[str, torch.Tensor], header_metadata: dict,
                       converter: str | None = None, values_check=None, rules: tuple = (),
                       folded: bool = False) -> AdapterFile:
    """An :class:`AdapterFile` from a file's tensors and header metadata (read or converted).

    Its values are not checked here: ``values_check`` (default: a check of ``tensors``)
    runs when they are first consumed, or when the reader asks for it at once. ``rules``:
    key rules of the reader's own, tried after the user's (see :class:`AdapterFile`).
    """
    if not tensors:
        raise AdapterError(f"{path}: the file holds no tensors; is it an adapter at all?")
    config = _read_peft_config(path, tensors)
    modules = group_parts(path, tensors)
    if values_check is None:
        values_check = FiniteCheck(path, tensors, memo=converter is None)
    metadata = diffusers_metadata(path, header_metadata)
    sources = AlphaSources(path, config, metadata, header_alpha(path, header_metadata))
    return AdapterFile(path, detect(tensors, header_metadata).NAME, modules, config, sources, converter,
                       values_check, tuple(rules), folded)


def reading_of(path: str, tensors: dict[str, torch.Tensor], header_metadata: dict) -> Reading:
    """A file's tensors and header metadata as a format module reads them (:mod:`.formats`)."""
    return Reading(path, tensors, header_metadata, split_key,
                   lambda **options: build_adapter_file(path, tensors, header_metadata, **options))


def open_adapter(path: str | os.PathLike):
    """``(file, mapping, tensors)`` of an adapter: the file ``path`` names (itself, or the one
    in the folder peft or diffusers wrote), mapped read-only, and its tensors by name.

    Every reader starts here, so a file that cannot be read is the same
    :class:`AdapterError` naming it whichever reader meets it.
    """
    path = resolve_file(os.fspath(path))
    if path.endswith(PICKLED):
        before = _stat(path)
        tensors = _torch_file(path)
        read_stamps.remember(path, before)
        read_stamps.check_read_whole(path, before)  # torch.load read it by path: one file throughout
        return path, _NoHeader(), tensors
    try:
        mapped = open_readonly(path)
        tensors = {name: mapped.get_tensor(name) for name in mapped.keys()}
    except SafetensorsError as exc:
        raise AdapterError(f"adapter {exc}") from None
    except OSError as exc:
        raise AdapterError(f"adapter {path}: cannot read it ({exc.strerror or exc})") from None
    read_stamps.remember(path, mapped.stat)
    return path, mapped, tensors


def _stat(path: str) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as exc:
        raise AdapterError(f"adapter {path}: cannot read it ({exc.strerror or exc})") from None


PICKLED = (".bin", ".pt", ".pth")  # torch.save's files: peft's adapter_model.bin, older trainers' weights


class _NoHeader:
    """The header metadata of a file that has none (torch.save's)."""

    @staticmethod
    def metadata() -> dict:
        return {}


def _torch_file(path: str) -> dict[str, torch.Tensor]:
    """A torch.save file's tensors, read as peft reads ``adapter_model.bin``: ``torch.load`` with
    ``weights_only=True`` (nothing but tensors and plain containers is unpickled, so a file
    cannot run code), its storages mapped where the file is a zip archive."""
    import pickle
    import zipfile

    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise AdapterError(f"adapter {path}: cannot read it as a torch.save file of tensors ({str(exc)[:200]}); "
                           "convert it to .safetensors") from None
    except OSError as exc:
        raise AdapterError(f"adapter {path}: cannot read it ({exc.strerror or exc})") from None
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in loaded.items()):
        raise AdapterError(f"adapter {path}: holds a {type(loaded).__name__}, not a dict of named tensors (a state "
                           "dict); save the adapter's state dict, or convert it to .safetensors")
    return loaded


def read_adapter(path: str | os.PathLike, check_values: bool = True) -> AdapterFile:
    """Read an adapter file (or the folder peft or diffusers wrote) into its normalized form.

    Every key must be a LoRA part this merge understands; a key of an unsupported
    variant (IA3, OFT, ...) or an unknown key is an error naming it, never skipped, and
    so is a NaN or an infinite value. ``check_values=False`` leaves that check (which
    reads every value) to the first use of the values: a merge runs it before the first
    layer it computes, so a start whose every layer is cached never reads them.
    """
    return read_opened(*open_adapter(path), check_values=check_values)


def read_opened(path: str, mapped, tensors: dict[str, torch.Tensor], check_values: bool = True) -> AdapterFile:
    """:func:`read_adapter` of a file :func:`open_adapter` opened already."""
    metadata = mapped.metadata()
    adapter = detect(tensors, metadata).read(reading_of(path, tensors, metadata))  # the first format that claims it
    if check_values:
        adapter.values_check()
    return adapter
