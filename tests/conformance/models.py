"""Tiny models for the conformance corpus, and the references each file is merged by.

Wan and Flux come from :mod:`tests.clients.tiny_models`; MiniMax-H3 (the family whose
ai-toolkit files carry their alpha in the safetensors header), QwenImage, SD3,
HunyuanVideo, LTX, ZImage and an SD 1.x UNet (3x3 convs) are built here. The
references are the libraries' own paths: diffusers' ``lora_state_dict`` (from the file,
so its header is read as diffusers reads it) + ``load_lora_adapter`` + ``fuse_lora``,
peft's ``merge_and_unload``, or the math ``W + delta`` where neither merges the layout.
"""

from __future__ import annotations

import os

import torch

from tests.clients import tiny_models as tm

H3 = {  # one head of 128: diffusers' DiffSynth conversion de-interleaves qkv at H3's head width
    "num_attention_heads": 1, "attention_head_dim": 128, "hidden_size": 128, "num_layers": 2, "num_refiner_layers": 1,
    "ffn_dim": 32, "in_channels": 4, "audio_in_channels": 4, "text_dim": 16, "freq_dim": 16,
    "time_embed_hidden_dim": 16, "time_embed_dim": 8, "rope_freq_dim": 4,
}

QWEN = {"patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 1, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 16, "axes_dims_rope": (4, 6, 6)}
SD3 = {"sample_size": 32, "patch_size": 1, "in_channels": 4, "num_layers": 1, "attention_head_dim": 8,
       "num_attention_heads": 4, "caption_projection_dim": 32, "joint_attention_dim": 32, "pooled_projection_dim": 64,
       "out_channels": 4}
HUNYUAN = {"in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 10, "num_layers": 1,
           "num_single_layers": 1, "num_refiner_layers": 1, "patch_size": 1, "patch_size_t": 1, "text_embed_dim": 16,
           "pooled_projection_dim": 8, "rope_axes_dim": (2, 4, 4)}
LTX = {"in_channels": 8, "out_channels": 8, "patch_size": 1, "patch_size_t": 1, "num_attention_heads": 4,
       "attention_head_dim": 8, "cross_attention_dim": 32, "num_layers": 1, "caption_channels": 32}
ZIMAGE = {"all_patch_size": (2,), "all_f_patch_size": (1,), "in_channels": 16, "dim": 32, "n_layers": 2,
          "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "qk_norm": True, "cap_feat_dim": 16,
          "axes_dims": [8, 4, 4], "axes_lens": [256, 32, 32]}
UNET = {"block_out_channels": (32, 64), "layers_per_block": 1, "sample_size": 16, "in_channels": 4, "out_channels": 4,
        "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"), "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
        "cross_attention_dim": 32, "norm_num_groups": 8, "attention_head_dim": 4}  # SD 1.x's shape: 3x3 convs
_OWN = {"h3": ("MiniMaxH3Transformer3DModel", "MiniMaxH3LoraLoaderMixin", H3),  # kinds tiny_models has not
        "qwen": ("QwenImageTransformer2DModel", "QwenImageLoraLoaderMixin", QWEN),
        "sd3": ("SD3Transformer2DModel", "SD3LoraLoaderMixin", SD3),
        "hunyuan": ("HunyuanVideoTransformer3DModel", "HunyuanVideoLoraLoaderMixin", HUNYUAN),
        "ltx": ("LTXVideoTransformer3DModel", "LTXVideoLoraLoaderMixin", LTX),
        "zimage": ("ZImageTransformer2DModel", "ZImageLoraLoaderMixin", ZIMAGE),
        "unet": ("UNet2DConditionModel", "StableDiffusionLoraLoaderMixin", UNET)}


def model_class(kind: str):
    import diffusers

    return getattr(diffusers, _OWN[kind][0]) if kind in _OWN else tm.classes(kind)[0]


def loader_class(kind: str):
    """The loader mixin whose ``lora_state_dict`` diffusers converts this kind's files with."""
    from diffusers import loaders

    return getattr(loaders, _OWN[kind][1]) if kind in _OWN else tm.classes(kind)[1]


def save_model(kind: str, folder) -> str:
    if kind not in _OWN:
        return tm.save_model(kind, folder)
    torch.manual_seed(0)
    model_class(kind)(**_OWN[kind][2]).save_pretrained(folder)
    return os.fspath(folder)


def load_model(kind: str, folder):
    return model_class(kind).from_pretrained(folder).eval()


def diffusers_fused(kind: str, model_folder, path: str, strength: float = 1.0):
    """diffusers' own path on a model: the file read by the loader's ``lora_state_dict`` (its
    header included), loaded with ``load_lora_adapter`` and fused."""
    model = load_model(kind, model_folder)
    unet = {"unet_config": model.config} if kind == "unet" else {}  # as load_lora_weights passes it (SGM names)
    out = loader_class(kind).lora_state_dict(os.path.dirname(path), weight_name=os.path.basename(path),
                                             return_lora_metadata=True, **unet)
    state, metadata = out[0], out[-1]
    alphas = out[1] if len(out) == 3 else None  # the UNet loaders hand kohya's alphas back beside the state
    model.load_lora_adapter(state, prefix="unet" if kind == "unet" else "transformer", network_alphas=alphas,
                            metadata=metadata, adapter_name="a")
    model.fuse_lora(lora_scale=strength)
    model.unload_lora()
    return model


def diffusers_adapter_fused(kind: str, model_folder, folder: str, strength: float = 1.0):
    """diffusers' path for a file of the model's own keys: ``model.load_lora_adapter`` + fuse."""
    model = load_model(kind, model_folder)
    model.load_lora_adapter(folder, weight_name="pytorch_lora_weights.safetensors", prefix=None, adapter_name="a")
    model.fuse_lora(lora_scale=strength)
    model.unload_lora()
    return model


def peft_merged(kind: str, model_folder, folder: str):
    from peft import PeftModel

    folder = folder if os.path.isdir(folder) else os.path.dirname(folder)  # adapter_model.bin named by its path
    return PeftModel.from_pretrained(load_model(kind, model_folder), folder).merge_and_unload()


def weights(model) -> dict[str, torch.Tensor]:
    return tm.weights(model)


def start_and_digest(kind: str, model_folder: str, cache: str, spec: dict) -> dict:
    """One server start: the model loaded, ``load_lora`` through the cache at ``cache``;
    its stats and a digest of every weight after (what a fresh-process test compares)."""
    import hashlib

    import lora_cache

    model = load_model(kind, model_folder)
    stats = lora_cache.load_lora(model, lora_cache.Adapter(**spec), cache_root=cache, progress=False)
    digest = hashlib.sha256()
    for name, weight in sorted(weights(model).items()):
        digest.update(name.encode() + weight.contiguous().view(torch.uint8).numpy().tobytes())
    return {"layers": stats.layers, "hit": stats.hit, "built": stats.built, "digest": digest.hexdigest()}
