"""Model families: one adapter file each, one registry; the Arch of a config dict without weights.

Adding a family means one adapter file exposing an `ENTRY: Family` and one line below; the tests
parametrised over FAMILIES then cover it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.errors import LMCError, ModelError
from engine.models import (
    hf_bert,
    hf_gemma,
    hf_gpt2,
    hf_llama,
    hf_mistral,
    hf_neox,
    hf_olmo,
    hf_phi,
    hf_qwen2,
    hf_qwen3,
    hf_roberta,
    reference,
    timm_vit,
)
from engine.models.base import Arch, Family, Model, Params
from engine.models.io import check_closed_world, check_output_dir, read_config
from engine.models.native import check_hf_config, fresh
from engine.models.reference import RefConfig
from engine.models.widening import widened

FAMILIES: dict[str, Family] = {
    reference.ENTRY.name: reference.ENTRY,
    hf_gpt2.ENTRY.name: hf_gpt2.ENTRY,
    hf_llama.ENTRY.name: hf_llama.ENTRY,
    hf_neox.ENTRY.name: hf_neox.ENTRY,
    hf_qwen2.ENTRY.name: hf_qwen2.ENTRY,
    hf_qwen3.ENTRY.name: hf_qwen3.ENTRY,
    hf_mistral.ENTRY.name: hf_mistral.ENTRY,
    hf_olmo.ENTRY.name: hf_olmo.ENTRY,
    hf_gemma.ENTRY.name: hf_gemma.ENTRY,
    hf_phi.ENTRY.name: hf_phi.ENTRY,
    timm_vit.ENTRY.name: timm_vit.ENTRY,
    hf_bert.ENTRY.name: hf_bert.ENTRY,
    hf_roberta.ENTRY.name: hf_roberta.ENTRY,
    hf_roberta.XLM_ENTRY.name: hf_roberta.XLM_ENTRY,
}


def family_of(path: Path) -> Family:
    """The family whose checkpoint lies in directory `path`."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"Model path {path} is not a directory.")
    check_closed_world(path)
    if (path / "config.json").exists() or (path / "config.json").is_symlink():
        read_config(path)  # names the problem (not JSON, not an object, auto_map, ...) before detection
    for fam in FAMILIES.values():
        if fam.detect(path):
            return fam
    raise ModelError(
        f"Model directory {path} is not a supported family (supported: {', '.join(FAMILIES)})."
    )


def _hf_module(config: dict, source: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    rest = {k: v for k, v in config.items() if k != "model_type"}
    try:
        hf = AutoConfig.for_model(config["model_type"], **rest)
        return AutoModelForCausalLM.from_config(hf)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelError(f"{source} could not be built from its config ({type(e).__name__}: {msg}).") from None


def meta_module(path: Path) -> tuple[Family, Arch, torch.nn.Module]:
    """The family, the Arch and the module of the model in directory `path`, the module built from config.json
    on the meta device (parameters with shapes, never storage); no weight file is read."""
    fam = family_of(path)  # reads config.json only
    config = read_config(path)
    source = f"Model directory {path}"
    with torch.device("meta"):
        if fam.name == "reference":
            rc = RefConfig.from_dict(config)
            return fam, rc.arch(), reference.Transformer(rc, init=False)
        if fam.name == "timm_vit":
            module = timm_vit.module_from_config(config, source)
            return fam, timm_vit.arch(module, source), module
        # the HF families: the adapter's own checks, then the module transformers builds
        return fam, arch_from_config(config, source), _hf_module(config, source)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Model:
    """Load a model directory of any registered family, its weights in the process's own memory; its weight files
    are checked from their headers first (safetensors, parameters floating point and of the config's shapes)."""
    from engine.models.io import check_weight_files

    family = family_of(Path(path))
    try:  # the shapes come from the config; a config this fails on, the family's load refuses in its own words
        module = meta_module(Path(path))[2]
    except LMCError:
        module = None
    if module is not None:
        check_weight_files(Path(path), {k: tuple(p.shape) for k, p in module.named_parameters()})
    model = family.load(Path(path), dtype=dtype)
    _own_memory(model.module)
    return model


@torch.no_grad()
def _own_memory(module: torch.nn.Module) -> None:
    """Copy weights that still live in a memory-mapped checkpoint into the process's own memory.

    Loaders may hand back tensors backed by the safetensors file's mapping. Reading them is free,
    but the first write into each page (in-place alignment, the LayerNorm rewrite) then copies it
    on a page fault: on GPT-2-small that cost 6-7 s of system time in a 12-20 s weight matching,
    against 0.3 s for this copy (bench/RESULTS.md). One tensor at a time; tied weights stay tied
    (the Parameter objects are kept, only their data is replaced).
    """
    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type == "cpu":
            t.data = t.data.clone()


def canonical(model: Model, copy: bool = True) -> Params:
    """The canonical params of `model`: fresh contiguous tensors, or with copy=False views of the module's
    own storage where the layout allows (no memory; never modify them in place unless you mean the model)."""
    p = FAMILIES[model.family].to_canonical(model)
    return {k: fresh(v) for k, v in p.items()} if copy else p


def set_canonical(model: Model, params: Params) -> None:
    FAMILIES[model.family].from_canonical(model, params)


def save_model(model: Model, path: str | Path, overwrite: bool = False, inputs: tuple = ()) -> None:
    """Save in the family's own format into directory `path` (engine.models.io.check_output_dir rules:
    a non-empty directory the tool did not write needs `overwrite`; an input directory is refused)."""
    check_output_dir(path, overwrite, inputs=(model.path, *inputs))
    FAMILIES[model.family].save(model, Path(path))


def model_logits(model: Model, inputs: torch.Tensor) -> torch.Tensor:
    """The family's logits; half-precision weights compute in float32 where the device lacks fast half-precision
    products (widening.widened), so such logits come back in float32."""
    with widened(model.module):
        return FAMILIES[model.family].logits(model, inputs)


def arch_from_config(config: dict, source: str = "config.json") -> Arch:
    """The Arch of a reference, HF GPT-2, Llama, Qwen2, Qwen3, Mistral, GPT-NeoX, BERT, RoBERTa, XLM-RoBERTa or timm
    ViT config dict (no weights needed)."""
    fam = config.get("family")
    if "model_type" in config:
        check_hf_config(config, source)  # sizes and flags typed before transformers builds anything
    if fam == "reference":
        return RefConfig.from_dict(config).arch()
    hf = {f.model_type: f for f in FAMILIES.values() if f.config_arch is not None}
    mt = config.get("model_type")
    if mt in hf:
        return hf[mt].config_arch(config, source)
    if fam == "timm_vit" or "architecture" in config:
        return timm_vit.arch(timm_vit.module_from_config(config, source), source)
    raise ModelError(f"{source} is not a reference, GPT-2, Llama, Qwen2, Qwen3, Mistral, GPT-NeoX, BERT, RoBERTa, "
                     "XLM-RoBERTa or timm ViT config.")


__all__ = [
    "FAMILIES",
    "Arch",
    "Family",
    "Model",
    "Params",
    "arch_from_config",
    "canonical",
    "family_of",
    "load_model",
    "model_logits",
    "save_model",
    "set_canonical",
]
