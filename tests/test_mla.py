"""MLA: shapes, causality, query compression and rotary on/off, against a naive explicit-softmax reference;
gradients checked in float64 against finite differences and against the reference's."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from k3train.models.k3.mla import MultiHeadLatentAttention, RotaryEmbedding, causal_attention

pytestmark = pytest.mark.usefixtures("one_thread")

D, H, T = 32, 4, 12


def make_mla(q_lora_rank=None, rope=False, seed=0) -> MultiHeadLatentAttention:
    torch.manual_seed(seed)
    return MultiHeadLatentAttention(
        D,
        H,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        q_lora_rank=q_lora_rank,
        rope=rope,
        max_seq_len=64,
    )


def naive_qkv(m: MultiHeadLatentAttention, x: torch.Tensor):
    """q, k [B, H, T, dn+dr], v [B, H, T, dv] straight from the weights, one head at a time (DeepSeek-V3 layout)."""
    B, T, _ = x.shape
    dn, dr, dv, r = m.dn, m.dr, m.dv, m.kv_lora_rank
    if hasattr(m, "q_b_proj"):
        q_all = F.rms_norm(x @ m.q_a_proj.weight.T, (m.q_a_proj.out_features,), m.q_a_norm.weight, m.q_a_norm.eps)
        q_all = q_all @ m.q_b_proj.weight.T
    else:
        q_all = x @ m.q_proj.weight.T
    kv_a = x @ m.kv_a_proj.weight.T
    c_kv, k_rope = kv_a[..., :r], kv_a[..., r:]
    kv_all = F.rms_norm(c_kv, (r,), m.kv_a_norm.weight, m.kv_a_norm.eps) @ m.kv_b_proj.weight.T
    qs, ks, vs = [], [], []
    for h in range(m.n_heads):
        q_h = q_all[..., h * (dn + dr) : (h + 1) * (dn + dr)]
        kv_h = kv_all[..., h * (dn + dv) : (h + 1) * (dn + dv)]
        q_nope, q_rope, k_rope_h = q_h[..., :dn], q_h[..., dn:], k_rope
        if m.rotary is not None:
            q_rope, k_rope_h = m.rotary(q_rope[:, :, None])[:, :, 0], m.rotary(k_rope[:, :, None])[:, :, 0]
        qs.append(torch.cat([q_nope, q_rope], -1))
        ks.append(torch.cat([kv_h[..., :dn], k_rope_h], -1))
        vs.append(kv_h[..., dn:])
    return torch.stack(qs, 1), torch.stack(ks, 1), torch.stack(vs, 1)


def naive_mla(m: MultiHeadLatentAttention, x: torch.Tensor) -> torch.Tensor:
    q, k, v = naive_qkv(m, x)
    T = x.shape[1]
    logits = (q @ k.transpose(-1, -2)) * (m.dn + m.dr) ** -0.5
    logits = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = logits.softmax(-1) @ v  # [B, H, T, dv]
    return o.transpose(1, 2).reshape(x.shape[0], T, -1) @ m.o_proj.weight.T


@pytest.mark.parametrize("q_lora_rank", [None, 8])
@pytest.mark.parametrize("rope", [False, True])
def test_matches_naive_reference_and_is_causal(q_lora_rank, rope):
    m = make_mla(q_lora_rank, rope)
    assert hasattr(m, "q_b_proj") == (q_lora_rank is not None) and (m.rotary is not None) == rope
    x = torch.randn(2, T, D)
    y = m(x)
    assert y.shape == (2, T, D)
    torch.testing.assert_close(y, naive_mla(m, x), rtol=1e-5, atol=1e-5)
    x2 = x.clone()
    x2[:, 7:] = torch.randn(2, T - 7, D)  # change only the future of position 6
    y2 = m(x2)
    torch.testing.assert_close(y2[:, :7], y[:, :7], rtol=0, atol=1e-6)
    assert (y2[:, 7:] - y[:, 7:]).abs().max() > 1e-3


def test_rotary_depends_only_on_relative_position():
    rot = RotaryEmbedding(8, max_seq_len=32, theta=10000.0)
    q, k = torch.randn(8), torch.randn(8)
    seq_q = q.expand(1, 32, 1, 8)
    seq_k = k.expand(1, 32, 1, 8)
    rq, rk = rot(seq_q)[0, :, 0], rot(seq_k)[0, :, 0]
    # the logit between positions (t, s) equals that at (t + 5, s + 5), and differs from the unrotated one
    torch.testing.assert_close(rq[9] @ rk[3], rq[14] @ rk[8], rtol=1e-5, atol=1e-5)
    assert abs(rq[9] @ rk[3] - q @ k) > 1e-3


@pytest.mark.parametrize("q_lora_rank", [None, 8])
@pytest.mark.parametrize("rope", [False, True])
def test_max_logit_equals_brute_force(q_lora_rank, rope):
    m = make_mla(q_lora_rank, rope, seed=1)
    x = torch.randn(3, T, D) * 3
    m(x)
    assert m.max_logit is None  # measured only when asked
    m.track_max_logit = True
    m(x)
    q, k, _ = naive_qkv(m, x)
    scale = (m.dn + m.dr) ** -0.5
    expected = torch.full((H,), float("-inf"))
    for b in range(3):
        for h in range(H):
            for i in range(T):
                for j in range(i + 1):  # causal pairs only
                    expected[h] = max(expected[h], scale * (q[b, h, i] @ k[b, h, j]))
    assert m.max_logit.dtype == torch.float32 and m.max_logit.shape == (H,)
    assert not m.max_logit.requires_grad
    torch.testing.assert_close(m.max_logit, expected, rtol=1e-5, atol=1e-5)
    # a running max over training passes (micro-batches); eval passes leave it alone
    m.eval()
    m(x * 10)
    torch.testing.assert_close(m.max_logit, expected, rtol=1e-5, atol=1e-5)
    m.train()
    m(x * 0.1)
    torch.testing.assert_close(m.max_logit, expected, rtol=1e-5, atol=1e-5)
    m(x[:1] * 2)
    assert (m.max_logit > expected).any()


def test_head_split_annotations():
    for q_lora_rank in (None, 8):
        m = make_mla(q_lora_rank)
        q_proj = m.q_proj if q_lora_rank is None else m.q_b_proj
        assert q_proj.weight.head_split == (H, 0) and q_proj.weight.shape[0] == H * (m.dn + m.dr)
        assert m.kv_b_proj.weight.head_split == (H, 0) and m.kv_b_proj.weight.shape[0] == H * (m.dn + m.dv)
        assert m.o_proj.weight.head_split == (H, 1) and m.o_proj.weight.shape[1] == H * m.dv
        assert not hasattr(m.kv_a_proj.weight, "head_split")  # shared across heads


def tiny_mla(q_lora_rank, rope, track_max_logit) -> MultiHeadLatentAttention:
    """float64 and a few hundred numbers in all, so finite differences over every input and weight stay cheap."""
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(
        8,
        2,
        kv_lora_rank=4,
        qk_nope_head_dim=4,
        qk_rope_head_dim=2,
        v_head_dim=3,
        q_lora_rank=q_lora_rank,
        rope=rope,
        max_seq_len=8,
    ).double()
    m.track_max_logit = track_max_logit
    for norm in (m.kv_a_norm, getattr(m, "q_a_norm", None)):
        if norm is not None:  # away from all-ones, so a gradient that ignored the norm weight would show
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    return m


# Every pair of (query compression, rotary, max-logit tracking) settings occurs in one of these four cases.
GRAD_CASES = [(None, False, False), (None, True, True), (3, False, True), (3, True, False)]
GRAD_IDS = [f"q_lora={q}-rope={rope}-track={track}" for q, rope, track in GRAD_CASES]


@pytest.mark.parametrize("q_lora_rank, rope, track_max_logit", GRAD_CASES, ids=GRAD_IDS)
def test_gradcheck_float64(q_lora_rank, rope, track_max_logit):
    m = tiny_mla(q_lora_rank, rope, track_max_logit)
    names = [name for name, _ in m.named_parameters()]
    weights = [p.detach().clone().requires_grad_() for p in m.parameters()]
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)

    def forward(x, *weights):
        return functional_call(m, dict(zip(names, weights)), (x,))

    assert torch.autograd.gradcheck(forward, (x, *weights), eps=1e-6, atol=1e-7, rtol=1e-5)
    assert (m.max_logit is not None) == track_max_logit  # the tracked passes were really checked


@pytest.mark.parametrize("q_lora_rank, rope, track_max_logit", GRAD_CASES, ids=GRAD_IDS)
def test_gradients_match_naive_reference_float64(q_lora_rank, rope, track_max_logit):
    """As test_kda.py does for chunk vs recurrent: one random upstream gradient through both, every gradient."""
    m = tiny_mla(q_lora_rank, rope, track_max_logit)
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 6, 8, dtype=torch.float64)
    grads = {}
    for name, fn in (("module", m), ("naive", lambda x: naive_mla(m, x))):
        m.zero_grad(set_to_none=True)
        x.grad = None
        (fn(x) * upstream).sum().backward()
        grads[name] = {"x": x.grad, **{n: p.grad for n, p in m.named_parameters()}}
    assert grads["module"].keys() == grads["naive"].keys()
    for key, expected in grads["naive"].items():
        assert expected is not None and expected.abs().max() > 0, f"{key}: no gradient through the reference"
        torch.testing.assert_close(grads["module"][key], expected, rtol=1e-10, atol=1e-12, msg=key)


@pytest.mark.parametrize("dk, dv", [(12, 6), (6, 12), (8, 8)])
def test_causal_attention_takes_the_fused_cpu_kernel_and_matches_explicit_softmax(dk, dv):
    """dk != dv would send torch's SDPA to its slow math path on CPU; the zero padding must change nothing."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, T, dk), torch.randn(2, 3, T, dk), torch.randn(2, 3, T, dv)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    expected = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~causal, float("-inf")).softmax(-1) @ v
    with torch.profiler.profile() as prof:
        out = causal_attention(q, k, v, 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    ops = {e.key for e in prof.key_averages()}
    assert (
        "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
        and "aten::_scaled_dot_product_attention_math" not in ops
    ), sorted(ops)
