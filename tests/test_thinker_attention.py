"""The torch thinker's grouped-query attention (engine_bridge/thinker/attention.py): the same numbers as
transformers' ``sdpa`` with its K/V heads copied per query head, without the copy.

How fast it is, against the copying kind, is benchmarks/engine_batch.py's business (``--history-tokens``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from torch import nn

from engine_bridge.thinker.attention import GROUPED_SDPA, grouped_sdpa_attention, use_grouped_sdpa
from engine_bridge.thinker.base import DecodingSettings
from engine_bridge.thinker.model_store import LoadedModel, build_tiny_random, load_tokenizer
from engine_bridge.thinker.torch_backend import TorchThinker, TorchThinkerConfig


class _Attention(nn.Module):
    """What transformers' attention functions read off a Llama attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return build_tiny_random(load_tokenizer(), seed=0)


@pytest.mark.parametrize("queries", [1, 4, 12])
@pytest.mark.parametrize("masked", [True, False])
def test_grouped_attention_equals_transformers_sdpa_bit_for_bit(queries: int, masked: bool) -> None:
    """9 query heads on 3 KV heads (SmolLM2's shape), a batch of 3: over 500 columns with a random boolean
    mask (every row keeps its last column), and without one as the model calls it (one query over 500 columns,
    a decode; several queries over as many columns, a first prefill, causal): exactly transformers' output."""
    gen = torch.Generator().manual_seed(queries)
    b, heads, kv_heads, dim = 3, 9, 3, 64
    length = 500 if masked or queries == 1 else queries
    query = torch.randn(b, heads, queries, dim, generator=gen)
    key = torch.randn(b, kv_heads, length, dim, generator=gen)
    value = torch.randn(b, kv_heads, length, dim, generator=gen)
    mask: torch.Tensor | None = None
    if masked:
        mask = torch.rand(b, 1, queries, length, generator=gen) > 0.3
        mask[..., -1] = True
    module = _Attention(heads // kv_heads)
    ours, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=dim**-0.5)
    theirs, _ = hf_sdpa.sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    assert ours.shape == (b, queries, heads, dim)
    assert torch.equal(ours, theirs)


def test_the_thinker_switches_grouped_models_and_leaves_others(tiny: LoadedModel) -> None:
    th = TorchThinker(TorchThinkerConfig(model="tiny-random"), loaded=tiny)
    assert th.model.config._attn_implementation == GROUPED_SDPA
    ungrouped = build_tiny_random(load_tokenizer(), num_heads=2, num_kv_heads=2)
    assert not use_grouped_sdpa(ungrouped.model)
    assert ungrouped.model.config._attn_implementation == "sdpa"


def test_masked_batched_steps_never_copy_kv_heads(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sessions decode as one generation group (an explicit mask on every step) and then take a second
    turn (a masked prefill over their context): transformers' head copy is never called, and the tokens are
    those of the same sessions decoding one by one."""
    decoding = DecodingSettings(max_tokens=12, ignore_eos=True)
    cfg = TorchThinkerConfig(model="tiny-random", decoding=decoding, max_context_tokens=256)
    ref = TorchThinker(cfg, loaded=tiny)
    sids = ["a", "b", "c"]

    def turn(th: TorchThinker, together: bool) -> dict[str, list[int | None]]:
        for sid in sids:
            th.begin_reply(sid)
        tokens: dict[str, list[int | None]] = {sid: [] for sid in sids}
        for _ in range(decoding.max_tokens or 0):
            outs = th.step(sids) if together else {s: th.step([s])[s] for s in sids}
            for sid, out in outs.items():
                tokens[sid].append(out.token_id)
        for sid in sids:
            th.end_reply(sid)
        return tokens

    expected: list[dict[str, list[int | None]]] = []
    for sid in sids:
        ref.open(sid, f"You are session {sid}.")
        ref.append(sid, "user", f"Question {ord(sid)}?")
    expected.append(turn(ref, together=False))
    for sid in sids:
        ref.append(sid, "user", "And then?")
    expected.append(turn(ref, together=False))

    def no_copy(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("K/V heads were copied per query head")

    monkeypatch.setattr(hf_sdpa, "repeat_kv", no_copy)
    th = TorchThinker(cfg, loaded=tiny)
    for sid in sids:
        th.open(sid, f"You are session {sid}.")
        th.append(sid, "user", f"Question {ord(sid)}?")
    got = [turn(th, together=True)]
    for sid in sids:
        th.append(sid, "user", "And then?")
    got.append(turn(th, together=True))
    assert got == expected
