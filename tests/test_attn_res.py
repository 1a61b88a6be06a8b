"""Attention residuals (k3train/models/k3/attn_res.py, KimiK3 with attn_res_block_size): the mix against a hand
computation and gradcheck, and the whole model in fp64 against a step-by-step loop of the block structure, in a full
forward and in decoding."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3train.models.k3.attn_res import AttnResMix, attn_res_mix

from helpers.decoding import incremental_logits
from helpers.tiny_k3 import batch, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

EPS = 1e-6


def sources(n=3, shape=(2, 5), d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    # different scales per source: the keys are RMS-normalised, the values are not
    return [(1 + 2 * i) * torch.randn(*shape, d, generator=g, dtype=dtype) for i in range(n)]


def weights(d=8, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return 1 + 0.5 * torch.randn(d, generator=g, dtype=dtype), torch.randn(1, d, generator=g, dtype=dtype)


# --- the mix -------------------------------------------------------------------------------------------------------


def test_mix_matches_a_hand_computation_token_by_token():
    vs = sources()
    norm_w, proj_w = weights()
    got = attn_res_mix(vs, norm_w, proj_w, EPS)
    assert got.shape == vs[0].shape and got.dtype == torch.float64
    for b in range(2):
        for t in range(5):
            scores = []
            for v in vs:
                rms = math.sqrt(sum(float(a) ** 2 for a in v[b, t]) / 8 + EPS)
                scores.append(sum(float(a) / rms * float(n) * float(p) for a, n, p in zip(v[b, t], norm_w, proj_w[0])))
            top = max(scores)
            p = [math.exp(s - top) for s in scores]
            p = [q / sum(p) for q in p]
            want = [sum(p[i] * float(vs[i][b, t, c]) for i in range(3)) for c in range(8)]
            torch.testing.assert_close(got[b, t], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def test_mix_is_proj_of_rmsnorm_as_the_checkpoint_stores_it():
    """The score is proj(RMSNorm(V_i)) with the stored modules: the query w = norm.weight * proj.weight[0]."""
    mix = AttnResMix(8, eps=EPS).double()
    norm_w, proj_w = weights()
    with torch.no_grad():
        mix.norm.weight.copy_(norm_w)
        mix.proj.weight.copy_(proj_w)
    assert mix.norm.weight.shape == (8,) and mix.proj.weight.shape == (1, 8) and mix.proj.bias is None
    vs = sources()
    scores = torch.cat([F.linear(F.rms_norm(v, (8,), norm_w, EPS), proj_w) for v in vs], dim=-1)  # [2, 5, n]
    want = (scores.softmax(-1).unsqueeze(-1) * torch.stack(vs, dim=-2)).sum(-2)
    torch.testing.assert_close(mix(vs), want, rtol=0, atol=1e-12)
    assert torch.equal(mix(vs), attn_res_mix(vs, norm_w, proj_w, EPS))


def test_one_source_or_equal_sources_come_back_unchanged():
    norm_w, proj_w = weights()
    (v,) = sources(n=1)
    assert torch.equal(attn_res_mix([v], norm_w, proj_w, EPS), v)
    torch.testing.assert_close(attn_res_mix([v, v, v], norm_w, proj_w, EPS), v, rtol=0, atol=1e-14)


def test_half_precision_sources_mix_in_fp32():
    """bf16 in, bf16 out, computed in fp32: exactly the fp32 mix of the same values rounded once, with or without
    autocast."""
    vs = [v.to(torch.bfloat16) for v in sources(dtype=torch.float32)]
    norm_w, proj_w = weights(dtype=torch.float32)
    want = attn_res_mix([v.float() for v in vs], norm_w, proj_w, EPS).to(torch.bfloat16)
    got = attn_res_mix(vs, norm_w, proj_w, EPS)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(attn_res_mix(vs, norm_w, proj_w, EPS), want)


def test_mix_gradcheck():
    vs = [v.requires_grad_() for v in sources(n=3, shape=(2, 3), d=5)]
    norm_w, proj_w = (w.requires_grad_() for w in weights(d=5))
    assert torch.autograd.gradcheck(lambda *a: attn_res_mix(a[:3], a[3], a[4], EPS), (*vs, norm_w, proj_w))


# --- the model -----------------------------------------------------------------------------------------------------


def hand_mix(values, norm, proj):
    """Mix(V) written out from its definition, with the model's parameters."""
    w = norm.weight * proj.weight[0]
    scores = torch.stack([(v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps) * w).sum(-1) for v in values])
    p = scores.softmax(0)
    return sum(p[i, ..., None] * v for i, v in enumerate(values))


def reference_logits(model, tokens, S):
    """The block structure step by step, from its pseudo-code (k3train/models/k3/model.py's module docstring)."""
    B = []
    h = model.embed_tokens(tokens)
    for layer_idx, layer in enumerate(model.layers):
        x = hand_mix(B + [h], layer.self_attention_res_norm, layer.self_attention_res_proj) if B else h
        if layer_idx % S == 0:
            B.append(h)
            s = 0
        else:
            s = h
        s = s + layer.mixer(layer.mixer_norm(x))
        s = s + layer.ffn(layer.ffn_norm(hand_mix(B + [s], layer.mlp_res_norm, layer.mlp_res_proj)))
        h = s
    return model.lm_head(model.norm(hand_mix(B + [h], model.output_attn_res_norm, model.output_attn_res_proj)))


def fp64_model(S, **overrides):
    """A tiny model in fp64, eval mode, with a non-zero router bias (routing must match between the paths) and
    non-trivial mixing norms (at init they are all 1)."""
    model = tiny_model(attn_res_block_size=S, **overrides).double().eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for moe in model.moe_layers().values():
            moe.expert_bias.copy_(0.05 * torch.randn(moe.expert_bias.shape, generator=g))
        for name, p in model.named_parameters():
            if "_res_norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "_res_proj" in name:
                p.mul_(20)  # init_std 0.02 -> ~0.4: scores of order one, far from a uniform mix
    return model


@pytest.mark.parametrize("S", [1, 2, 3, 5])
def test_forward_equals_the_step_by_step_block_structure(S):
    """4 layers; S=1: every layer a block; 2: two blocks; 3: a full block and a partial one; 5: one partial block."""
    model = fp64_model(S)
    x, y = batch(B=2, T=24)
    with torch.no_grad():
        logits, _ = model(x)
        want = reference_logits(model, x, S)
        _, loss = model(x, y)
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-12)
    want_loss = F.cross_entropy(want.reshape(-1, want.shape[-1]), y.reshape(-1))
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-12)  # an fp64 model's loss is fp64 too


@pytest.mark.parametrize("S, ratio", [(1, "3:1"), (2, "3:1"), (3, "1:1")])
def test_decoding_equals_the_full_forward(S, ratio):
    """forward_cached over a 10-token prompt, then token by token, gives forward()'s logits: the mix is over depth
    for the same token and needs no cache."""
    model = fp64_model(S, kda_mla_ratio=ratio)
    x, _ = batch(B=2, T=24, seed=2)
    with torch.no_grad():
        full, _ = model(x)
    steps = incremental_logits(model, x, prefill=10)
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-10)


def test_block_starts():
    assert [layer.starts_block for layer in tiny_model(attn_res_block_size=2, n_layers=5).layers] == [
        True,
        False,
        True,
        False,
        True,
    ]
    assert [layer.starts_block for layer in tiny_model(attn_res_block_size=3, n_layers=5).layers] == [
        True,
        False,
        False,
        True,
        False,
    ]
    assert not any(layer.starts_block for layer in tiny_model().layers)


def test_block_sums_stay_in_the_stream_dtype_under_autocast():
    """Under bf16 autocast the mixer and FFN outputs are bf16; a block's running sum starts from the attention
    output cast to the embedding's dtype (fp32), as the x + f(x) stream stays fp32."""
    model = tiny_model(attn_res_block_size=2).eval()
    x, _ = batch(B=1, T=8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h, blocks = model.embed_tokens(x), ()
        for layer in model.layers:
            h, blocks = layer(h, blocks), blocks + (h,) if layer.starts_block else blocks
            assert h.dtype == torch.float32
        logits, _ = model(x)
    assert torch.isfinite(logits.float()).all()
