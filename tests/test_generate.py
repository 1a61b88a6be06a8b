"""Decoding: incremental logits equal the full forward's; the caches keep the sizes they promise; sampling."""

import pytest
import torch

from k3train.inference import sampling
from k3train.inference.sampling import Sampler, generate
from k3train.models.k3 import KimiK3, KimiK3Config
from k3train.models.k3.cache import MLACache
from k3train.models.kda.state import KDAState

from helpers.decoding import V, build, incremental_logits, relative_error
from helpers.tiny_k3 import TINY

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "name, changes, mixers",
    [
        ("k3_tiny", {}, {"kda", "mla"}),
        ("k3_mla_only", {}, {"mla"}),
        ("k3_tiny", {"kda_mla_ratio": "1:0"}, {"kda"}),  # a KDA-only stack
    ],
)
def test_incremental_decoding_equals_the_full_forward(name, changes, mixers):
    model = build(name, **changes)
    assert {layer.mixer_type for layer in model.layers} == mixers
    tokens = torch.randint(0, V, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(tokens)
    # A 70-token prompt crosses k3_tiny's 64-token KDA chunk, then 30 single-token steps.
    assert relative_error(incremental_logits(model, tokens, prefill=70), full) < 1e-4


@pytest.mark.parametrize(
    "changes",
    [
        {"mla_rope": True, "q_lora_rank": 16, "kda_conv_size": 2},  # rotary keys at their positions, query compression
        {"kda_conv_size": 1, "kda_implementation": "recurrent", "tie_embeddings": True},
    ],
)
def test_incremental_decoding_equals_the_full_forward_in_other_configurations(changes):
    model = KimiK3(KimiK3Config(**{**TINY, "n_layers": 3, "kda_mla_ratio": "1:1", **changes})).eval()
    tokens = torch.randint(0, 61, (3, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = model(tokens)
    for prefill in (1, 17):
        assert relative_error(incremental_logits(model, tokens, prefill), full) < 1e-4


def test_kda_state_stays_fixed_and_mla_cache_holds_the_latent_and_rope_key_per_token():
    model = build("k3_tiny")
    c = model.config
    cache = model.empty_cache(batch=2, capacity=300)
    kda = [s for s in cache if isinstance(s, KDAState)]
    mla = [s for s in cache if isinstance(s, MLACache)]
    assert len(kda) == 3 and len(mla) == 1  # k3_tiny: 3 KDA then 1 MLA
    key_dim = c.kda_n_heads * c.kda_head_dim
    assert kda[0].conv_q.shape == (2, c.kda_conv_size - 1, key_dim)
    assert kda[0].recurrent.shape == (2, c.kda_n_heads, c.kda_head_dim, c.kda_head_dim)
    assert kda[0].recurrent.dtype == torch.float32

    def sizes(tokens: int) -> tuple[list[int], list[int]]:
        with torch.no_grad():
            model.forward_cached(torch.randint(0, V, (2, tokens)), cache)
        return [s.numel() for s in kda], [s.numel() for s in mla]

    kda_after_prompt, mla_after_prompt = sizes(10)
    for _ in range(5):
        sizes(1)
    kda_after_long, mla_after_long = sizes(200)
    assert kda_after_long == kda_after_prompt  # no growth with the context
    per_token_per_row = c.kv_lora_rank + c.qk_rope_head_dim
    assert mla_after_prompt == [2 * 10 * per_token_per_row]
    assert mla_after_long == [2 * 215 * per_token_per_row] and mla[0].length == 215
    assert mla[0].latent.shape == (2, 300, c.kv_lora_rank) and mla[0].k_rope.shape == (2, 300, c.qk_rope_head_dim)
    with pytest.raises(ValueError, match="holds 300 positions; 215 are filled and 100 more"):
        sizes(100)


def test_decoding_never_moves_the_router_bias():
    model = build("k3_tiny")
    before = {i: moe.expert_bias.clone() for i, moe in model.moe_layers().items()}
    list(generate(model, torch.randint(0, V, (2, 8)), 5, Sampler(temperature=1.0)))
    for i, moe in model.moe_layers().items():
        assert torch.equal(moe.expert_bias, before[i])


def test_greedy_generation_is_the_same_with_and_without_the_cache(monkeypatch):
    monkeypatch.setattr(sampling, "PREFILL_CHUNK", 5)  # the 12-token prompt goes in as 5 + 5 + 2
    model = build("k3_tiny")
    prompt = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    cached = torch.stack(list(generate(model, prompt, 20, Sampler(temperature=0))), dim=1)
    recomputed = torch.stack(list(generate(model, prompt, 20, Sampler(temperature=0), use_cache=False)), dim=1)
    assert torch.equal(cached, recomputed)
    assert cached.shape == (2, 20)


def test_sampler_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(2000, -1)
    gen = torch.Generator().manual_seed(0)
    assert Sampler(temperature=0)(logits[:1]).tolist() == [0]
    assert set(Sampler(top_k=2)(logits, gen).tolist()) == {0, 1}
    assert set(Sampler(top_p=0.7)(logits, gen).tolist()) == {0, 1}  # 0.5 < 0.7: the second token completes it
    assert set(Sampler(top_p=0.5)(logits, gen).tolist()) == {0}
    assert set(Sampler(temperature=1.0)(logits, gen).tolist()) == {0, 1, 2, 3}
    a = Sampler()(logits, torch.Generator().manual_seed(5))
    assert torch.equal(a, Sampler()(logits, torch.Generator().manual_seed(5)))  # seeded: reproducible


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"temperature": -1}, "temperature=-1 must be >= 0"),
        ({"top_k": -2}, "top_k=-2 must be >= 0"),
        ({"top_p": 0}, r"top_p=0 must be in \(0, 1\]"),
    ],
)
def test_sampler_refuses_bad_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        Sampler(**settings)


def test_rotary_positions_past_the_table_are_refused():
    model = KimiK3(
        KimiK3Config(
            vocab_size=61,
            d_model=32,
            n_layers=1,
            kda_mla_ratio="0:1",
            max_seq_len=8,
            mla_n_heads=2,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            mla_rope=True,
            dense_ffn_dim=32,
        )
    ).eval()
    cache = model.empty_cache(1, 20)
    with torch.no_grad():
        model.forward_cached(torch.zeros(1, 8, dtype=torch.long), cache)  # positions 0..7: the whole table
        with pytest.raises(ValueError, match="position 8 is past the rotary table's 8 positions"):
            model.forward_cached(torch.zeros(1, 1, dtype=torch.long), cache)
