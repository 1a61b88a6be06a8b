"""MLA: shapes, causality, query compression and rotary on/off, against a naive explicit-softmax reference;
gradients checked in float64 against finite differences and against the reference's. Kimi K3's output gate and
latent-norm epsilon: against a reference built by hand, through cached decoding and QK-Clip, and off = as before."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from k3train.models.common.attention import RotaryEmbedding, causal_attention, visible_keys
from k3train.models.k3 import mla
from k3train.models.k3.config import KimiK3Config
from k3train.models.k3.costs import max_logit_pairs
from k3train.models.k3.flops import mla_macs
from k3train.models.k3.mla import MultiHeadLatentAttention, causal_max_logit
from k3train.models.layout import parameter_layouts
from k3train.optim.param_groups import partition_parameters

pytestmark = pytest.mark.usefixtures("one_thread")

D, H, T = 32, 4, 12


def make_mla(q_lora_rank=None, rope=False, seed=0, **kw) -> MultiHeadLatentAttention:
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
        **kw,
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
    o = (logits.softmax(-1) @ v).transpose(1, 2).reshape(x.shape[0], T, -1)  # [B, T, H*dv]
    if m.g_proj is not None:
        o = o * torch.sigmoid(x @ m.g_proj.weight.T)
    return o @ m.o_proj.weight.T


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


# ---- QK-Clip's max logit in tiles ------------------------------------------------------------------------------


def dense_max_logit(q, k, scale, visible):
    """The former causal_max_logit, kept here as the reference: one [H, T, S] fp32 matmul a row, masked whole by
    visible [B or 1, T, S]."""
    best = torch.full((q.shape[1],), float("-inf"))
    for b in range(q.shape[0]):
        logits = (q[b].float() @ k[b].float().transpose(-1, -2)) * scale
        pairs = visible[b if visible.shape[0] > 1 else 0]
        best = torch.maximum(best, logits.masked_fill(~pairs, float("-inf")).amax(dim=(-1, -2)))
    return best


def document_ids_of(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


TRAP = 20.0  # a trap pair's logit is TRAP ** 2 (400) before scaling; every other pair stays under about 4 * TRAP


def trapped(B: int, T: int, S: int, seed: int = 0):
    """q [B, T * S, T, 8], k [B, T * S, S, 8] random, with one head for every query-key pair (i, j), in row
    (i + j) % B, whose query i and key j are both TRAP along the first axis: that head's max is the trap's exactly
    when the pair is counted, so a pair wrongly counted or wrongly skipped changes its head's max by hundreds."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T * S, T, 8, generator=gen), torch.randn(B, T * S, S, 8, generator=gen)
    for h, (i, j) in enumerate(trap_pairs(T, S)):
        q[(i + j) % B, h, i], k[(i + j) % B, h, j] = 0.0, 0.0
        q[(i + j) % B, h, i, 0], k[(i + j) % B, h, j, 0] = TRAP, TRAP
    return q, k


def trap_pairs(T: int, S: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(T) for j in range(S)]


# (B, T queries, start: the position of the first, the rows' document lengths over all start + T positions or None)
MAX_LOGIT_CASES = {
    "causal": (1, 40, 0, None),
    "causal, 3 rows": (3, 40, 0, None),
    # boundaries at 8 and 16 (tile edges for sides 4, 8 and 16), 21 (inside a tile), 39 (the last query alone)
    "documents": (2, 40, 0, [[8, 8, 5, 18, 1], [16, 1, 23]]),
    "cp": (2, 24, 40, None),  # a rank's 24 queries at positions 40..63 against keys 0..63
    # a document across the slice's start (36..47), boundaries at 48 (tile edges) and 53 (inside), and row 1 one
    # document from position 1 on, so that its first key is another document
    "cp, documents": (2, 24, 40, [[12, 24, 12, 5, 11], [1, 63]]),
}
SIDES = [1, 5, 8, 16, 64, None]  # 8 divides both T (40, 24), 5 only 40, 16 neither; 64 and None: one tile


@pytest.mark.parametrize("case", MAX_LOGIT_CASES)
def test_tiled_max_logit_equals_the_dense_one(case):
    """Every tile side, against the dense reference: the same value within fp32 rounding (the tiles' smaller
    matmuls may sum a product's terms in another order) and, through the traps, the same pairs exactly, each of
    the T x S pairs checked by a head of its own."""
    B, T, start, lengths = MAX_LOGIT_CASES[case]
    S = start + T
    ids = None if lengths is None else document_ids_of(lengths)
    query_ids = None if ids is None else ids[:, start:]
    q, k = trapped(B, T, S)
    visible = visible_keys(T, start, query_ids, ids, torch.device("cpu"))
    expected = dense_max_logit(q, k, 0.3, visible)
    counted = torch.tensor([bool(visible[(i + j) % B if len(visible) > 1 else 0, i, j]) for i, j in trap_pairs(T, S)])
    assert torch.equal(expected > 0.3 * TRAP**2 / 2, counted)  # each trap decides its head's max
    for side in SIDES:
        got = causal_max_logit(q, k, 0.3, query_ids, ids if start else None, tile=side)
        assert got.dtype == torch.float32 and got.shape == (T * S,)
        torch.testing.assert_close(got, expected, rtol=1.3e-6, atol=0, msg=f"tile {side}")


class LargestOutputs(TorchDispatchMode):
    """Records every op's output size, and the shape of every matmul's output."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.matmuls = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        if func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
            self.matmuls.append(tuple(out.shape))
        return out


def test_a_tiny_block_runs_many_tiles_over_the_causal_pairs(monkeypatch):
    """The block, not a row count, sets the tiles: at 3 x 2 x 2 values a tile is 2 x 2 for 3 heads, 20 queries make
    10 tiles, and their matmuls cover the causal pairs plus the diagonal tiles' upper halves (max_logit_pairs), not
    the T x T square."""
    monkeypatch.setattr(mla, "MAX_LOGIT_BLOCK_VALUES", 3 * 2 * 2)
    H, T = 3, 20
    q, k = torch.randn(2, H, T, 8), torch.randn(2, H, T, 8)
    with LargestOutputs() as seen:
        got = causal_max_logit(q, k, 0.5)
    torch.testing.assert_close(got, dense_max_logit(q, k, 0.5, visible_keys(T, 0, None, None, q.device)))
    assert mla.max_logit_tile(H, "cpu") == 2
    assert len(seen.matmuls) == 2 * sum(range(1, 11))  # per row, tile n sees n key spans
    assert {s for s in seen.matmuls} == {(H, 2, 2)}
    assert sum(math.prod(s) for s in seen.matmuls) == 2 * H * max_logit_pairs(T, T, 2) == 2 * H * 220
    with LargestOutputs() as seen:  # a cp rank's: the last 11 queries against all 20 keys, its last tile of 1 row
        causal_max_logit(q[:, :, 9:], k, 0.5)
    assert sum(math.prod(s) for s in seen.matmuls) == 2 * H * max_logit_pairs(11, T, 2) == 2 * H * 170


def test_a_long_sequence_never_holds_its_dense_logits():
    """16,384 positions and 2 heads: the dense [H, T, T] logits would be 2 GiB; no op of the tiled measurement
    outputs more than the CPU block (64 MiB), and its matmuls skip about half of the square."""
    H, T = 2, 16384
    q, k = torch.randn(1, H, T, 2), torch.randn(1, H, T, 2)
    with LargestOutputs() as seen:
        got = causal_max_logit(q, k, 1.0)
    assert got.shape == (H,) and torch.isfinite(got).all()
    side = mla.max_logit_tile(H, "cpu")
    assert seen.largest <= mla.MAX_LOGIT_BLOCK_VALUES == H * T * T // 32  # a 32nd of the dense logits
    computed = sum(math.prod(s) for s in seen.matmuls)
    assert computed == H * max_logit_pairs(T, T, side) and computed < 0.6 * H * T * T


class SecondHalf:
    """Stands for ContextParallel on rank 1 of 2: gather hands back the first half's tensor, given, and this one."""

    rank = 1

    def __init__(self, latent: torch.Tensor, ids: torch.Tensor) -> None:
        self.latent, self.ids = latent, ids

    def offset(self, local_length: int) -> int:
        return local_length

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [self.ids if t.dtype == torch.long else self.latent, t]


@pytest.mark.parametrize("documents", [False, True])
def test_a_layer_on_the_second_half_of_a_row_measures_its_queries_against_every_key_before(documents):
    """The layer's own wiring under cp: the queries' start, the gathered keys and their document ids."""
    m = make_mla(rope=True, seed=2)
    m.train()
    m.track_max_logit = True
    x = torch.randn(2, 2 * T, D) * 3
    ids = document_ids_of([[5, 14, 5], [13, 11]]) if documents else None  # row 0's second document spans both halves
    with torch.no_grad():
        m.context_parallel = SecondHalf(m.kv_a_proj(x[:, :T]), None if ids is None else ids[:, :T])
        m(x[:, T:], None if ids is None else ids[:, T:])
    q, k, _ = naive_qkv(m, x)
    visible = visible_keys(T, T, None if ids is None else ids[:, T:], ids, x.device)
    torch.testing.assert_close(m.max_logit, dense_max_logit(q[:, :, T:], k, m.scale, visible), rtol=1e-5, atol=1e-5)


def test_head_split_annotations():
    for q_lora_rank in (None, 8):
        m = make_mla(q_lora_rank)
        q_proj = m.q_proj if q_lora_rank is None else m.q_b_proj
        splits = {name: layout.head_split for name, layout in parameter_layouts(m).items()}
        q_name = "q_proj.weight" if q_lora_rank is None else "q_b_proj.weight"
        # kv_a_proj is shared across heads: no split
        assert splits == {q_name: (H, 0), "kv_b_proj.weight": (H, 0), "o_proj.weight": (H, 1)}
        assert q_proj.weight.shape[0] == H * (m.dn + m.dr) and m.kv_b_proj.weight.shape[0] == H * (m.dn + m.dv)
        assert m.o_proj.weight.shape[1] == H * m.dv
        assert m.g_proj is None
    gated = make_mla(output_gate=True)
    assert parameter_layouts(gated)["g_proj.weight"].head_split == (H, 0)
    assert gated.g_proj.weight.shape == (H * gated.dv, D)
    assert gated.g_proj.bias is None
    # Muon sees g_proj as H per-head matrices, like the other per-head attention projections (not as a KDA gate).
    by_name = {a.name: a for a in partition_parameters(gated)}
    assert by_name["g_proj.weight"].group == "muon_attention" and by_name["g_proj.weight"].head_split == (H, 0)


def tiny_mla(q_lora_rank, rope, track_max_logit, output_gate=False) -> MultiHeadLatentAttention:
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
        output_gate=output_gate,
    ).double()
    m.track_max_logit = track_max_logit
    for norm in (m.kv_a_norm, getattr(m, "q_a_norm", None)):
        if norm is not None:  # away from all-ones, so a gradient that ignored the norm weight would show
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    return m


# Every pair of (query compression, rotary, max-logit tracking) settings occurs in one of the first four cases
# (ungated); the gated two cover each setting of the other three once more.
GRAD_CASES = [
    (None, False, False, False),
    (None, True, True, False),
    (3, False, True, False),
    (3, True, False, False),
    (None, True, False, True),
    (3, False, True, True),
]
GRAD_IDS = [f"q_lora={q}-rope={rope}-track={track}" + ("-gated" if gate else "") for q, rope, track, gate in GRAD_CASES]


@pytest.mark.parametrize("q_lora_rank, rope, track_max_logit, output_gate", GRAD_CASES, ids=GRAD_IDS)
def test_gradcheck_float64(q_lora_rank, rope, track_max_logit, output_gate):
    m = tiny_mla(q_lora_rank, rope, track_max_logit, output_gate)
    names = [name for name, _ in m.named_parameters()]
    weights = [p.detach().clone().requires_grad_() for p in m.parameters()]
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)

    def forward(x, *weights):
        return functional_call(m, dict(zip(names, weights)), (x,))

    assert torch.autograd.gradcheck(forward, (x, *weights), eps=1e-6, atol=1e-7, rtol=1e-5)
    assert (m.max_logit is not None) == track_max_logit  # the tracked passes were really checked


@pytest.mark.parametrize("q_lora_rank, rope, track_max_logit, output_gate", GRAD_CASES, ids=GRAD_IDS)
def test_gradients_match_naive_reference_float64(q_lora_rank, rope, track_max_logit, output_gate):
    """As test_kda.py does for chunk vs recurrent: one random upstream gradient through both, every gradient."""
    m = tiny_mla(q_lora_rank, rope, track_max_logit, output_gate)
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


# Kimi K3: the output gate and the latent norms' epsilon.
UNGATED_KEYS = {"kv_a_proj.weight", "kv_a_norm.weight", "kv_b_proj.weight", "o_proj.weight"}


@pytest.mark.parametrize("q_lora_rank", [None, 8])
@pytest.mark.parametrize("rope", [False, True])
def test_gate_off_is_the_ungated_layer(q_lora_rank, rope):
    """output_gate=False (the default) adds nothing: the same parameters, drawn from the same random numbers, and
    bitwise the same output; turning the gate on only adds g_proj, drawn after everything else."""
    query_keys = {"q_proj.weight"} if q_lora_rank is None else {"q_a_proj.weight", "q_a_norm.weight", "q_b_proj.weight"}
    default = make_mla(q_lora_rank, rope)
    off = make_mla(q_lora_rank, rope, output_gate=False, latent_norm_eps=None)
    on = make_mla(q_lora_rank, rope, output_gate=True)
    assert default.state_dict().keys() == off.state_dict().keys() == UNGATED_KEYS | query_keys
    assert on.state_dict().keys() == UNGATED_KEYS | query_keys | {"g_proj.weight"}
    for name, p in default.state_dict().items():
        assert torch.equal(p, off.state_dict()[name]) and torch.equal(p, on.state_dict()[name]), name
    x = torch.randn(2, T, D)
    assert torch.equal(default(x), off(x))
    assert not torch.allclose(on(x), default(x))


@pytest.mark.parametrize("q_lora_rank", [None, 8])
@pytest.mark.parametrize("rope", [False, True])
def test_gated_output_is_ungated_attention_times_sigmoid_gate_float64(q_lora_rank, rope):
    """The gated layer = o_proj(a * sigmoid(x W_g^T)), with a the ungated layer's attention output (what its o_proj
    receives) for the same weights: built by hand from the ungated module."""
    gated = make_mla(q_lora_rank, rope, output_gate=True).double()
    ungated = make_mla(q_lora_rank, rope).double()
    ungated.load_state_dict({k: v for k, v in gated.state_dict().items() if k != "g_proj.weight"})
    seen = []
    ungated.o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    x = torch.randn(2, T, D, dtype=torch.float64)
    ungated(x)
    attention = seen[0]  # [B, T, H*dv]
    assert attention.shape == (2, T, H * gated.dv)
    expected = (attention * torch.sigmoid(x @ gated.g_proj.weight.T)) @ gated.o_proj.weight.T
    torch.testing.assert_close(gated(x), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gated(x), naive_mla(gated, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("q_lora_rank", [None, 8])
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("output_gate", [False, True])
def test_cached_decoding_matches_full_forward_float64(q_lora_rank, rope, output_gate):
    """The prompt in one forward_cached call, then one token at a time: the absorbed latent path (with the gate
    applied per new token) gives the full forward's output."""
    m = make_mla(q_lora_rank, rope, output_gate=output_gate).double().eval()
    x = torch.randn(2, T, D, dtype=torch.float64)
    prefill = 5
    with torch.no_grad():
        full = m(x)
        cache = m.empty_cache(2, T, x.device, x.dtype)
        steps = [m.forward_cached(x[:, :prefill], cache)]
        steps += [m.forward_cached(x[:, t : t + 1], cache) for t in range(prefill, T)]
    assert cache.length == T
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)


def norm_eps_of(m: MultiHeadLatentAttention) -> dict[str, float]:
    """Every submodule with an epsilon (a norm), by name."""
    return {name: module.eps for name, module in m.named_modules() if hasattr(module, "eps")}


@pytest.mark.parametrize("q_lora_rank", [None, 8])
def test_latent_norm_eps_reaches_the_latent_norms_only(q_lora_rank):
    latent_norms = {"kv_a_norm"} | ({"q_a_norm"} if q_lora_rank is not None else set())
    k3 = make_mla(q_lora_rank, norm_eps=1e-5, latent_norm_eps=1e-6, output_gate=True)
    assert norm_eps_of(k3) == dict.fromkeys(latent_norms, 1e-6)
    assert norm_eps_of(make_mla(q_lora_rank, norm_eps=1e-5)) == dict.fromkeys(latent_norms, 1e-5)  # None: norm_eps
    # and it is the epsilon the forward uses: the same output as the layer built with norm_eps=1e-6, bitwise
    x = torch.randn(2, T, D) * 1e-3  # small latents, so that eps matters
    plain = make_mla(q_lora_rank, norm_eps=1e-6, output_gate=True)
    assert torch.equal(k3(x), plain(x))
    assert not torch.allclose(make_mla(q_lora_rank, norm_eps=1e-6, latent_norm_eps=1e-2)(x), make_mla(q_lora_rank)(x))


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("q_lora_rank", [None, 8])
def test_qk_clip_scales_the_gated_layer_logits_by_gamma(q_lora_rank, rope):
    """scale_qk_heads_(gamma) scales head h's logits (every causal pair) by gamma[h] with the gate on, exactly as
    for the ungated layer with the same weights, and leaves g_proj alone; the tracked max logit follows."""
    gated = make_mla(q_lora_rank, rope, seed=2, output_gate=True).double()
    ungated = make_mla(q_lora_rank, rope, seed=2).double()
    ungated.load_state_dict({k: v for k, v in gated.state_dict().items() if k != "g_proj.weight"})
    x = torch.randn(2, T, D, dtype=torch.float64) * 3

    def logits(m):
        q, k, _ = naive_qkv(m, x)
        return (q @ k.transpose(-1, -2)) * m.scale  # [B, H, T, T]

    before = logits(gated)
    gated.track_max_logit = True
    gated(x)
    max_before = gated.max_logit.clone()
    gate_weight = gated.g_proj.weight.clone()
    gamma = torch.tensor([0.25, 1.0, 0.5625, 0.140625])  # squares of 1/2, 1, 3/4, 3/8: exact fp32 square roots
    gated.scale_qk_heads_(gamma)
    ungated.scale_qk_heads_(gamma)
    after = logits(gated)
    torch.testing.assert_close(after, before * gamma.double()[None, :, None, None], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(after, logits(ungated), rtol=0, atol=0)
    assert torch.equal(gated.g_proj.weight, gate_weight)
    gated.max_logit = None
    gated(x)
    torch.testing.assert_close(gated.max_logit, max_before * gamma, rtol=1e-6, atol=1e-6)


def test_mla_macs_count_the_gate():
    """The gate costs d_model * n_heads * v_head_dim multiply-adds per token: g_proj's weight, once per token."""
    fields = dict(d_model=64, mla_n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    ungated, gated = KimiK3Config(**fields), KimiK3Config(**fields, mla_output_gate=True)
    m = MultiHeadLatentAttention(64, 4, 16, 8, 4, 6, output_gate=True)
    for seq_len in (1, 256):
        assert mla_macs(gated, seq_len) - mla_macs(ungated, seq_len) == m.g_proj.weight.numel() == 64 * 4 * 6
