"""HF RoBERTa (`transformers.RobertaForMaskedLM`, `RobertaModel`) and XLM-RoBERTa (`XLMRobertaForMaskedLM`,
`XLMRobertaModel`: the same modules under model_type "xlm-roberta"): BERT's post-LayerNorm encoder
(engine/models/hf_bert.py, docs/MATH.md section 9) under other names, so the same symmetry group.

What differs from BERT, none of it in the group:
- the native keys: the encoder under `roberta.`; the masked-LM head is `lm_head.dense`, `lm_head.layer_norm`
  and `lm_head.bias`, the decoder's weight tied to the word embedding and its bias to `lm_head.bias`;
- positions: HF numbers the tokens of a sequence from pad_token_id + 1 (a padding token gets position
  pad_token_id and the tokens after it keep counting), so the first pad_token_id + 1 rows of the table hold no
  position of an unpadded sequence and the context (`Arch.n_ctx`) is max_position_embeddings - pad_token_id - 1;
  the canonical `embed.pos` is the whole table, every row a residual writer like BERT's;
- the head's activation is the erf GELU whatever hidden_act says (BERT's head uses hidden_act);
- no pre-training layout: the masked LM has no pooler; an encoder without a head has one unless built without
  it (`add_pooling_layer`).
Token type 0 everywhere and no padding mask, as for BERT. Other heads are refused by name.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.models.base import Model
from engine.models.hf_bert import Variant, hf_family

FAMILY, XLM_FAMILY = "hf_roberta", "hf_xlm_roberta"
CLASS, ENCODER = "RobertaForMaskedLM", "RobertaModel"
XLM_CLASS, XLM_ENCODER = "XLMRobertaForMaskedLM", "XLMRobertaModel"
LAYOUTS, XLM_LAYOUTS = (CLASS, ENCODER), (XLM_CLASS, XLM_ENCODER)

ROBERTA = Variant(
    family=FAMILY, model_type="roberta", config_name="RoBERTa", display="RoBERTa (Hugging Face transformers)",
    reference="RoBERTa (Liu et al., 2019); transformers.RobertaForMaskedLM, RobertaModel",
    config_class="RobertaConfig", layouts=LAYOUTS, prefix="roberta",
    head=("lm_head.dense.", "lm_head.layer_norm.", "lm_head.bias"), offset=True, head_act="gelu",
)
XLM_ROBERTA = replace(
    ROBERTA, family=XLM_FAMILY, model_type="xlm-roberta", config_name="XLM-RoBERTa",
    display="XLM-RoBERTa (Hugging Face transformers)",
    reference="XLM-RoBERTa (Conneau et al., 2020); transformers.XLMRobertaForMaskedLM, XLMRobertaModel",
    config_class="XLMRobertaConfig", layouts=XLM_LAYOUTS,
)

HF, XLM = hf_family(ROBERTA), hf_family(XLM_ROBERTA)
MODEL_TYPE, XLM_MODEL_TYPE = HF.model_type, XLM.model_type
arch, wrap, detect, load, save = HF.arch, HF.wrap, HF.detect, HF.load, HF.save
to_canonical, from_canonical = HF.to_canonical, HF.from_canonical


def build(config, seed: int = 0, dtype: torch.dtype = torch.float32, layout: str = CLASS) -> Model:
    """A freshly initialised RoBERTa of `layout` (LAYOUTS; HF's own init) for tests."""
    return HF.build(config, seed, dtype, model_class=layout)


def build_xlm(config, seed: int = 0, dtype: torch.dtype = torch.float32, layout: str = XLM_CLASS) -> Model:
    """A freshly initialised XLM-RoBERTa of `layout` (XLM_LAYOUTS; HF's own init) for tests."""
    return XLM.build(config, seed, dtype, model_class=layout)


ENTRY, XLM_ENTRY = HF.entry(), XLM.entry()
