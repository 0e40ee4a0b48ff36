"""Two diffusers transformer classes from tiny configs, adapters written by peft and diffusers,
and the references lora_cache is held to: diffusers' load + fuse_lora, peft's merge_and_unload."""

from __future__ import annotations

import os

import torch

FLUX = {
    "patch_size": 1, "in_channels": 8, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
    "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32, "axes_dims_rope": [4, 4, 8],
}
WAN = {
    "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 4, "out_channels": 4,
    "text_dim": 16, "freq_dim": 32, "ffn_dim": 32, "num_layers": 2, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32,
}
FLUX2 = {  # Flux.2: fused single-block projections, SwiGLU feed-forwards, shared modulations
    "patch_size": 1, "in_channels": 8, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
    "num_attention_heads": 2, "joint_attention_dim": 32, "timestep_guidance_channels": 16, "mlp_ratio": 3.0,
    "axes_dims_rope": (4, 4, 4, 4),
}
TARGETS = {
    "flux": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_mlp", "proj_out", "ff.net.2"],
    "wan": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"],
}
RANK, ALPHA = 8, 16  # scale 2: metadata that is ignored shows up as half the delta


def classes(kind: str):
    """``(model class, pipeline class)`` of a kind."""
    import diffusers

    names = {"flux": ("FluxTransformer2DModel", "FluxPipeline"), "wan": ("WanTransformer3DModel", "WanPipeline"),
             "flux2": ("Flux2Transformer2DModel", "Flux2Pipeline")}[kind]
    return tuple(getattr(diffusers, name) for name in names)


def save_model(kind: str, folder, dtype=torch.float32) -> str:
    """A tiny model of ``kind`` written with save_pretrained (random weights, fixed seed)."""
    model_cls, _ = classes(kind)
    torch.manual_seed(0)
    model_cls(**{"flux": FLUX, "wan": WAN, "flux2": FLUX2}[kind]).to(dtype).save_pretrained(folder)
    return os.fspath(folder)


def load_model(kind: str, folder, dtype=None):
    """from_pretrained, as users load: the weights stay views of the checkpoint mapping."""
    model_cls, _ = classes(kind)
    return model_cls.from_pretrained(folder, **({"torch_dtype": dtype} if dtype else {})).eval()


def write_adapters(kind: str, model_folder, out, seed: int = 1, **config) -> dict[str, str]:
    """One random LoRA, saved by peft (folder) and by diffusers (with and without metadata);
    ``config`` adds LoraConfig fields (``rank_pattern``, ``alpha_pattern``, ``use_rslora``)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    _, pipe_cls = classes(kind)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS[kind], init_lora_weights=False, **config)
    torch.manual_seed(seed)
    peft_model = get_peft_model(load_model(kind, model_folder), config)
    paths = {"peft": os.path.join(out, "peft")}
    peft_model.save_pretrained(paths["peft"])
    layers = {k.removeprefix("base_model.model."): v for k, v in get_peft_model_state_dict(peft_model).items()}
    for name, metadata in (("diffusers_meta", config.to_dict()), ("diffusers_plain", None)):
        paths[name] = os.path.join(out, name)
        pipe_cls.save_lora_weights(paths[name], transformer_lora_layers=layers,
                                   transformer_lora_adapter_metadata=metadata)
    return paths


def weights(model) -> dict[str, torch.Tensor]:
    """The model's weights by their plain names (peft's wrappers' ``base_layer`` removed)."""
    return {k.replace(".base_layer", ""): v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}


def pipeline(kind: str, model, **components):
    """The kind's pipeline around ``model``, its other components absent (LoRA needs none)
    unless ``components`` gives them (``transformer_2=``, ``boundary_ratio=`` for Wan 2.2)."""
    import inspect

    _, pipe_cls = classes(kind)
    names = [n for n in inspect.signature(pipe_cls.__init__).parameters if n not in ("self", "transformer")]
    return pipe_cls(transformer=model, **{**dict.fromkeys(names), **components})


def diffusers_fused(kind: str, model_folder, adapters, dtype=None):
    """diffusers' own path: ``pipe.load_lora_weights`` per adapter, ``set_adapters``, ``fuse_lora``.

    ``adapters`` is a path or a list of ``(path, strength)``."""
    adapters = [(adapters, 1.0)] if isinstance(adapters, (str, os.PathLike)) else adapters
    pipe = pipeline(kind, load_model(kind, model_folder, dtype))
    names = [f"a{i}" for i in range(len(adapters))]
    for name, (path, _) in zip(names, adapters):
        pipe.load_lora_weights(path, adapter_name=name, weight_name=_weight_name(path))
    pipe.set_adapters(names, [strength for _, strength in adapters])
    pipe.fuse_lora(adapter_names=names)
    return pipe.transformer


def peft_merged(kind: str, model_folder, adapter_folder: str, dtype=None):
    """peft's own path: PeftModel.from_pretrained + merge_and_unload."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_model(kind, model_folder, dtype), adapter_folder).merge_and_unload()


def _weight_name(adapter: str) -> str | None:
    return "pytorch_lora_weights.safetensors" if os.path.isdir(adapter) else None


def inputs(kind: str) -> dict:
    gen = torch.Generator().manual_seed(7)
    if kind == "flux":
        return {
            "hidden_states": torch.randn(1, 16, 8, generator=gen),
            "encoder_hidden_states": torch.randn(1, 4, 32, generator=gen),
            "pooled_projections": torch.randn(1, 32, generator=gen),
            "timestep": torch.tensor([0.5]), "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(4, 3),
        }
    return {
        "hidden_states": torch.randn(1, 4, 2, 4, 4, generator=gen),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=gen), "timestep": torch.tensor([500]),
    }


@torch.no_grad()
def forward(model, kind: str) -> torch.Tensor:
    return model(**inputs(kind), return_dict=False)[0].double()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| over the whole tensor."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
