"""What a deployment config becomes: immutable records (named tuples), one per section."""

from __future__ import annotations

from typing import Mapping, NamedTuple

from .source import ConfigOrigin

__all__ = [  # the choices (OFFLOAD_MODES, ...) are the parsers', not the package's
    "HostConfig",
    "DeviceConfig",
    "TransferConfig",
    "WorkloadConfig",
    "ParallelConfig",
    "ComponentConfig",
    "AdapterConfig",
    "LoraCacheConfig",
    "LoraConfig",
    "DeploymentConfig",
]

OFFLOAD_MODES = ("layerwise", "full", "none")
LOAD_MODES = ("mapped", "copied")
DTYPES = ("bf16", "fp16", "fp32", "fp8", "int8", "uint8")


class HostConfig(NamedTuple):
    """The host limit the deployment plans for, and what is kept back from it."""

    limit: int | None  # None: "auto", the tighter of MemTotal and the cgroup limit
    reserve: int
    max_pinned_fraction: float | None = 0.75
    max_pinned_bytes: int | None = None
    reserve_source: str = "config"  # "default", "config", or "measured" (resolved by planners.reserve)
    reserve_floor: int = 1024**3  # the least a measured reserve may be
    max_pinned_from: str = ""  # where max_pinned_bytes came from when not the config (a rank's share, in words)

    def max_pinned(self, limit: int) -> int:
        """The most bytes that may be pinned under ``limit``."""
        if self.max_pinned_bytes is not None:
            return min(self.max_pinned_bytes, limit)
        return int(limit * (self.max_pinned_fraction if self.max_pinned_fraction is not None else 1.0))


class DeviceConfig(NamedTuple):
    """The VRAM the streamed component may use; ``vram == 0`` streams every layer."""

    vram: int = 0
    reserve: int = 0


class TransferConfig(NamedTuple):
    """The cost model, in bytes per second; measured values should replace the defaults."""

    pinned_h2d: float = 24e9
    pageable_h2d: float = 8e9
    disk_read: float = 3e9
    source: str = "default"  # "default", "config", or "measured" (resolved by planners.calibration)


class WorkloadConfig(NamedTuple):
    steps: int
    passes_per_step: int = 1

    @property
    def passes(self) -> int:
        """How often a streamed layer moves per request."""
        return self.steps * self.passes_per_step


class ParallelConfig(NamedTuple):
    """The ranks on one host (``parallel:``, ``--ranks``, ``LOCAL_WORLD_SIZE``) and what they split."""

    ranks: int = 1
    tensor_parallel: int = 1
    split: tuple[str, ...] = ()  # components divided among the tensor-parallel ranks
    source: str = "default"  # "default", "config", "--ranks" or "LOCAL_WORLD_SIZE"
    local_rank: int = 0


class ComponentConfig(NamedTuple):
    """One component: a checkpoint (``path``) or declared sizes (``size``)."""

    name: str
    offload: str
    path: str | None = None
    layer_pattern: str | tuple[str, ...] | None = None  # one block pattern or several
    layer_count: int | None = None
    size: int | None = None
    lora_target_bytes: int | None = None
    lora_target_patterns: tuple[str, ...] = ()
    dtype: str | None = None
    variant: str | None = None  # the checkpoint folder's weights variant the server loads ("fp16"), as diffusers'
    load: str = "mapped"
    prefetch: int = 1
    steps: int | None = None  # experts that take turns: the steps of a request this one runs (None: every step)

    @property
    def has_lora_targets(self) -> bool:
        return bool(self.lora_target_bytes) or bool(self.lora_target_patterns)


class AdapterConfig(NamedTuple):
    """One adapter: file, strength, and optional overrides (see ``lora_cache.Adapter``).

    ``rules`` are ``({match: REGEX, replace: MODULE}, ...)`` tried before the built-in
    key prefixes; ``strict: false`` turns keys that match nothing into a warning.
    """

    path: str
    strength: float = 1.0
    alpha: float | None = None
    rules: tuple = ()
    strict: bool = True
    rslora: bool | None = None


class LoraCacheConfig(NamedTuple):
    """``roots`` is the ordered list of cache roots (read-only ones first, say, then a
    writable one); ``root`` is the first of them, and a config's ``lora.cache.root: DIR``
    is the one-element list."""

    root: str | None = None
    enabled: bool = True
    max_size: int | None = None
    roots: tuple[str, ...] = ()


class LoraConfig(NamedTuple):
    """Adapters and the merged-weight cache (read by the LoRA provider).

    Adapter paths are not checked here: the loader checks them, so a deployment can
    be planned on a machine that does not hold the files.
    """

    adapters: tuple[AdapterConfig, ...] = ()
    cache: LoraCacheConfig = LoraCacheConfig()
    component: str | None = None


class DeploymentConfig(NamedTuple):
    deployment: str
    host: HostConfig
    device: DeviceConfig
    transfer: TransferConfig
    workload: WorkloadConfig
    components: Mapping[str, ComponentConfig]
    lora: LoraConfig | None
    origin: ConfigOrigin
    parallel: ParallelConfig = ParallelConfig()

    @property
    def streamed_components(self) -> tuple[ComponentConfig, ...]:
        """Every component streamed layer by layer, in config order."""
        return tuple(c for c in self.components.values() if c.offload == "layerwise")

    def moves(self, name: str) -> int:
        """How often ``name`` moves per request: a streamed one every pass of the steps it runs
        (an expert only its share), a fully offloaded one once."""
        component = self.components[name]
        if component.offload != "layerwise":
            return 1
        steps = component.steps if component.steps is not None else self.workload.steps
        return steps * self.workload.passes_per_step

    def alternating(self) -> tuple[str, ...]:
        """The experts that take turns at a boundary step (each runs only its ``steps``)."""
        return tuple(c.name for c in self.components.values() if c.steps is not None)

    @property
    def streamed(self) -> ComponentConfig | None:
        """The component streamed layer by layer (``offload: layerwise``), if any."""
        return next((c for c in self.components.values() if c.offload == "layerwise"), None)

    @property
    def merge_target(self) -> ComponentConfig | None:
        """The component a LoRA merge writes into.

        ``lora.component``, else the one that declares ``lora_targets``, else, when
        adapters are listed, the streamed component given by a checkpoint: its targets
        are read from the adapters' and the checkpoint's headers
        (:mod:`planners.adapter_targets`).
        """
        if self.lora is not None and self.lora.component:
            return self.components[self.lora.component]
        declared = next((c for c in self.components.values() if c.has_lora_targets), None)
        if declared is not None or self.lora is None or not self.lora.adapters:
            return declared
        streamed = self.streamed
        return streamed if streamed is not None and streamed.path is not None else None
