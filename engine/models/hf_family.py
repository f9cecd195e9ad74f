"""Hugging Face families as data: an `HFFamily` names a family's transformers classes, the map from its
native parameter names to canonical roles, the options it refuses, and the few functions that really
differ; its methods are the family's adapter (engine.models.base.Family).

What every HF family shares, written once here:
- detection: config.json's model_type;
- loading: the config is refused in one sentence before any weight is read (field types, quantization
  and foreign attention kernels, transformers' own validation, then the options the canonical layout
  cannot express), then `native.load_hf` (safetensors only, nothing missing, finite float weights);
- saving with `save_pretrained`, the directory put in place in one step (`native.save_hf`);
- building a freshly initialised model of a config (HF's own init, under a private seed) for tests and
  the zoo, refused before construction when the layout cannot express it;
- the canonical conversion, driven by the family's `KeyMap`: each `Key` pairs canonical keys with one
  native parameter and a `Conv`, the two linear maps between their layouts (views where they can be).

Options are refused with one sentence: "<source> uses <option>, which the engine does not support
(<why>)."; a config transformers rejects: "<source> is not a valid <config_name> config (<reason>)."
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import ModelError
from engine.models import native as nat
from engine.models.base import Arch, Family, Model, Params
from engine.models.io import HF_RULES, check_fields, read_config, refuse_optional_features
from engine.models.reference import ROPE_SCALINGS

Refuse = Callable[[str, str], None]  # refuse(option, why) raises the family's one-sentence ModelError

# ---------------------------------------------------------------------------------------------
# The key map: native parameter <-> canonical tensors


@dataclass(frozen=True)
class Conv:
    """One native tensor <-> its canonical tensors (several for a fused projection): `to` and `back` are
    affine (linear but for Gemma's norm offset) and each other's inverse, so a path in either layout is the same
    path; `to` returns views of the native tensor where the layout allows."""

    to: Callable[[torch.Tensor, Arch], Sequence[torch.Tensor]]
    back: Callable[[Sequence[torch.Tensor], Arch], torch.Tensor]


def _heads(a: Arch, kv: bool) -> int:
    return a.n_kv_heads if kv else a.n_heads


def _reader(kv: bool) -> Conv:
    return Conv(lambda t, a: (nat.heads_in(t.T, _heads(a, kv)),),  # [n*d, D] -> [n, D, d]
                lambda ts, a: nat.heads_in_native(ts[0]).T)


def _head_bias(kv: bool) -> Conv:
    return Conv(lambda t, a: (t.reshape(_heads(a, kv), -1),), lambda ts, a: ts[0].reshape(-1))  # [n*d] <-> [n, d]


SAME = Conv(lambda t, a: (t,), lambda ts, a: ts[0])
LINEAR = Conv(lambda t, a: (t.T,), lambda ts, a: ts[0].T)  # nn.Linear [out, in] <-> x @ W [in, out]
QUERY, KEY_VALUE = _reader(False), _reader(True)  # nn.Linear reading the residual into n_heads / n_kv_heads heads
WRITER = Conv(lambda t, a: (nat.heads_out(t.T, a.n_heads),),  # nn.Linear [D, h*d] -> [h, d, D]
              lambda ts, a: nat.heads_out_native(ts[0]).T)
QUERY_BIAS, KEY_VALUE_BIAS = _head_bias(False), _head_bias(True)


@dataclass(frozen=True)
class Key:
    """Canonical key(s) from one native parameter by `conv`. `when` names an Arch flag the pair exists under
    ("!flag": exists when the flag is false), empty for always. A `native` of None is a norm gain the family
    does not store (a LayerNorm without parameters, as OLMo's): canonically a gain of 1 [D], and only a gain of
    1 can be written back."""

    canonical: str | tuple[str, ...]
    native: str | None
    conv: Conv = SAME
    when: str = ""

    def present(self, a: Arch) -> bool:
        if not self.when:
            return True
        return not getattr(a, self.when[1:]) if self.when[0] == "!" else bool(getattr(a, self.when))


@dataclass(frozen=True)
class KeyMap:
    """A family's native <-> canonical names, in canonical order: `embed` before the blocks, `block` once per
    layer (canonical keys under "blocks.{l}.", native ones under `block_native` with {l} the layer), `final`
    after them. The order is the canonical dict's order."""

    embed: tuple[Key, ...]
    block_native: str
    block: tuple[Key, ...]
    final: tuple[Key, ...]

    def pairs(self, a: Arch) -> Iterator[tuple[tuple[str, ...], str | None, Conv]]:
        """(canonical keys, native name, conv) of every parameter `a` has; the native name is None for a gain
        the family does not store (Key)."""
        def one(key: Key, canon: str, native: str):
            names = (key.canonical,) if isinstance(key.canonical, str) else key.canonical
            return tuple(canon + n for n in names), None if key.native is None else native + key.native, key.conv

        yield from (one(k, "", "") for k in self.embed if k.present(a))
        for l in range(a.n_layers):
            yield from (one(k, f"blocks.{l}.", self.block_native.format(l=l)) for k in self.block if k.present(a))
        yield from (one(k, "", "") for k in self.final if k.present(a))


# ---------------------------------------------------------------------------------------------
# Refusals


@dataclass(frozen=True)
class Refusal:
    """An option the canonical layout cannot express, refused when `applies(config)`; `option` is formatted
    with the transformers config as `c` ("hidden_act={c.hidden_act!r}")."""

    applies: Callable[[Any], bool]
    option: str
    why: str


ROPE_SCALING = Refusal(lambda c: nat.rope_parameters(c).get("rope_type", "default") != "default",
                       "rope_type={c.rope_parameters[rope_type]!r}",
                       "RoPE frequency scaling; only standard RoPE is supported")
# the Llama-layout families: standard RoPE, or the frequency scalings the reference family computes as well
SCALED_ROPE = Refusal(
    lambda c: nat.rope_parameters(c).get("rope_type", "default") not in ("default", *ROPE_SCALINGS),
    "rope_type={c.rope_parameters[rope_type]!r}",
    f"RoPE frequency scaling other than {' or '.join(repr(k) for k in ROPE_SCALINGS)}, the only ones supported")


def activation(field: str, supported: Sequence[str], why: str = "") -> Refusal:
    """Refuse an activation (config field `field`) that is not one of `supported`."""
    return Refusal(lambda c: getattr(c, field) not in supported, f"{field}={{c.{field}!r}}",
                   why or f"supported: {sorted(supported)}")


# ---------------------------------------------------------------------------------------------
# The family


def _transformers(name: str) -> type:
    import transformers

    return getattr(transformers, name)


@dataclass(frozen=True)
class HFFamily:
    """One HF family: its names, classes, key map and refusals, and the hooks where it really differs. Its
    methods are the adapter; `entry()` is its registry entry."""

    name: str  # registry name, "hf_llama"
    model_type: str  # config.json's model_type, "llama"
    config_name: str  # the config in sentences: "Llama config uses ...", "is not a valid Llama config"
    display: str
    reference: str
    config_class: str  # transformers class names: "LlamaConfig", "LlamaForCausalLM"
    model_class: str
    keys: KeyMap | Callable[[Model], KeyMap]  # a callable: the key map depends on the module (BERT's layouts)
    # the Arch of a transformers config that passed `refusals`; it refuses, by refuse(option, why), what needs
    # arithmetic on the config to tell
    summary: Callable[[Any, Refuse], Arch]
    refusals: tuple[Refusal, ...] = ()
    prepare: Callable[[torch.nn.Module], None] | None = None  # on every module handed out (float64 switches)
    load_class: Callable[[Path], str] | None = None  # the class to load a directory as; None: model_class
    logits: Callable[[Model, torch.Tensor], torch.Tensor] = nat.causal_lm_logits
    twin: Callable[[Model], Model] | None = None

    # -----------------------------------------------------------------------------------------
    # Configs

    def config_from_dict(self, config: dict, source: str = "The config"):
        """The transformers config of a config.json dict, or one sentence saying why transformers rejects it."""
        from huggingface_hub.errors import StrictDataclassError

        try:
            return _transformers(self.config_class)(**{k: v for k, v in config.items() if k != "model_type"})
        except (StrictDataclassError, TypeError, ValueError, KeyError) as e:  # KeyError: a RoPE parameter missing
            text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            lines = [s.strip() for s in text.strip().splitlines() if s.strip()]
            why = " ".join(lines[:2])[:300] or type(e).__name__
            raise ModelError(f"{source} is not a valid {self.config_name} config ({why}).") from None

    def arch(self, config, source: str = "") -> Arch:
        """The architecture summary of a transformers config; refuses options the canonical layout cannot
        express."""
        source = source or f"{self.config_name} config"

        def refuse(option: str, why: str) -> None:
            raise ModelError(f"{source} uses {option}, which the engine does not support ({why}).")

        for r in self.refusals:
            if r.applies(config):
                refuse(r.option.format(c=config), r.why)
        return self.summary(config, refuse)

    def config_arch(self, config: dict, source: str) -> Arch:
        """The Arch of a config.json dict, without weights (engine.models.arch_from_config)."""
        return self.arch(self.config_from_dict(config, source), source)

    def check_config(self, path: Path) -> None:
        """Refuse the config.json of directory `path` in one sentence before any weight is read."""
        cfg, f = read_config(path), str(Path(path) / "config.json")
        check_fields(cfg, HF_RULES, f)
        refuse_optional_features(cfg, f)
        self.arch(self.config_from_dict(cfg, f"The config.json of model directory {path}"), f"Model directory {path}")

    # -----------------------------------------------------------------------------------------
    # Adapter

    def wrap(self, module, name: str = "", path: Path | None = None, source: str = "") -> Model:
        """A Model handle around a module of this family (prepared, its architecture checked)."""
        if self.prepare is not None:
            self.prepare(module)
        a = self.arch(module.config, source)
        return Model(self.name, a, module.eval(), module.config.to_dict(), name=name, path=path)

    def build(self, config, seed: int = 0, dtype: torch.dtype = torch.float32, model_class: str = "") -> Model:
        """A freshly initialised model (HF's own init) of a config or config dict, for tests and the zoo."""
        if isinstance(config, dict):
            config = self.config_from_dict(config)
        self.arch(config)  # refuse before spending time on construction
        config._attn_implementation = "sdpa"  # the kernel load_hf asks for (eager runs softmax in float32)
        with nat.seeded(seed):
            module = _transformers(model_class or self.model_class)(config)
        return self.wrap(module.to(dtype))

    def detect(self, path: Path) -> bool:
        return nat.hf_model_type(path) == self.model_type

    def load(self, path: Path, dtype: torch.dtype = torch.float32) -> Model:
        path = Path(path)
        if self.detect(path):  # otherwise load_hf names what the directory holds instead
            self.check_config(path)
        cls = self.load_class(path) if self.load_class is not None else self.model_class
        module = nat.load_hf(_transformers(cls), path, dtype, self.model_type, self.display)
        return self.wrap(module, name=path.name, path=path, source=f"Model directory {path}")

    def save(self, model: Model, path: Path) -> None:
        nat.save_hf(model.module, Path(path))

    def keymap(self, model: Model) -> KeyMap:
        return self.keys if isinstance(self.keys, KeyMap) else self.keys(model)

    def to_canonical(self, model: Model) -> Params:
        a, module = model.arch, model.module
        ref = next(module.parameters())
        p: Params = {}
        for canon, native, conv in self.keymap(model).pairs(a):
            if native is None:  # a gain the family does not store: 1
                p[canon[0]] = torch.ones(a.d_model, dtype=ref.dtype, device=ref.device)
                continue
            p.update(zip(canon, conv.to(module.get_parameter(native), a), strict=True))
        return {k: v.detach() for k, v in p.items()}  # views: engine.models.canonical copies them

    def from_canonical(self, model: Model, params: Params) -> None:
        a, native = model.arch, {}
        for canon, n, conv in self.keymap(model).pairs(a):
            if n is not None:
                native[n] = conv.back([params[k] for k in canon], a)
            elif not bool((params[canon[0]] == 1).all()):
                raise ModelError(f"The {self.config_name} family stores no {canon[0]}: its norms have no parameters, "
                                 "so only a gain of 1 can be written into this model.")
        nat.copy_into(model.module, native)  # tied parameters appear once: the tied head has no key

    def entry(self) -> Family:
        return Family(
            name=self.name, display_name=self.display, reference=self.reference, detect=self.detect,
            load=self.load, save=self.save, to_canonical=self.to_canonical, from_canonical=self.from_canonical,
            logits=self.logits, twin=self.twin, model_type=self.model_type, config_arch=self.config_arch,
        )
