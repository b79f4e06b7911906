"""Scaled-dot-product attention that keeps grouped-query K/V grouped, with a mask too.

transformers' ``sdpa`` attention asks torch for grouped-query attention (``enable_gqa``) only when no mask is
given; with a mask it first copies every key and value head once per query head of its group
(``repeat_kv``). The torch thinker passes an explicit boolean mask to every batched decode step and every
later-turn prefill, so with SmolLM2 (9 query heads on 3 KV heads) each layer copied the group's whole KV
three-fold on every step: work that grows with the context, and the reason a 30-minute soak's p95 rose 1.47x
as the conversations lengthened. torch's ``scaled_dot_product_attention`` takes the mask and ``enable_gqa``
together; on CPU it gives bit-identical results to the copied heads (tests/test_thinker_attention.py) in about a
fifth of the time at 3,000 columns (a micro-benchmark of one layer: 6.7 vs 1.4 ms for 4 rows), and
benchmarks/engine_batch.py ``--compare-attention`` measures the whole model. On CUDA torch picks the kernel itself
(its math kernel where a fused one lacks grouped support); not measured there (no GPU was available).

Everything else follows transformers' ``sdpa`` function: causal only when no mask is given and more than one
query, the module's scaling, outputs as ``[batch, query, heads, head_dim]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_SDPA = "livekit_omni_grouped_sdpa"
"""The ``attn_implementation`` name under which :func:`grouped_sdpa_attention` is registered."""


def grouped_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query [B, H, q, D]``, ``key``/``value [B, Hkv, L, D]`` (H a multiple of Hkv) -> ``[B, q, H, D]``."""
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"{GROUPED_SDPA} does not support position_bias; use the model's own attention")
    grouped = query.shape[1] != key.shape[1]
    causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal and attention_mask is None and query.shape[2] > 1,
        enable_gqa=grouped,
    )
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: nn.Module) -> bool:
    """Switch a loaded transformers model from ``sdpa`` to the grouped kind; returns whether it switched.

    Models on another attention (eager, flash) or without grouped heads are left as they are."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads or heads == kv_heads:
        return False
    model.set_attn_implementation(GROUPED_SDPA)  # type: ignore[operator]
    return True


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
