"""QK-Clip: an MLA layer driven past tau, clipped, then measured again on the same batch stays at or under tau.

Exact (up to fp32 rounding) for NoPE AND for RoPE: a head's logit is q_nope.k_nope + q_rope.k_rope; the first
term scales by sqrt(g) * sqrt(g) and the second by g (query rows only: the shared rotary key is untouched), and
the rotation is linear in the query, so rotating a query scaled by g gives the rotated query scaled by g. What
does NOT hold, with or without RoPE, is a bound on other inputs: the clip is computed from one batch's logits,
and in a deep model it also changes the inputs of later layers.
"""

import math

import pytest
import torch
from torch import nn

from k3train.models.k3 import KimiK3
from k3train.models.k3.mla import MultiHeadLatentAttention
from k3train.optim.qk_clip import qk_clip_, reset_max_logits, set_max_logit_tracking

H, TAU = 4, 30.0


class TwoMLA(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.a = MultiHeadLatentAttention(32, H, 16, 8, 4, 8, **kw)
        self.b = MultiHeadLatentAttention(32, H, 16, 8, 4, 8, **kw)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("q_lora_rank", [None, 8])
def test_clipped_layer_measures_at_most_tau(rope, q_lora_rank):
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(32, H, 16, 8, 4, 8, q_lora_rank=q_lora_rank, rope=rope, max_seq_len=32)
    wrapper = nn.ModuleDict({"attn": m})
    with torch.no_grad():  # drive heads 0 and 2 far past tau; heads 1 and 3 stay small
        q_out = m.q_out_proj.weight.view(H, 12, -1)
        q_out[[0, 2]] *= 40.0
        m.kv_b_proj.weight.view(H, 16, -1)[[0, 2], :8] *= 10.0
    x = torch.randn(2, 16, 32)
    assert set_max_logit_tracking(wrapper, True) == 1
    m(x)
    before = m.max_logit.clone()
    assert before[0] > TAU and before[2] > TAU and before[1] < TAU and before[3] < TAU
    untouched = {n: p.clone() for n, p in m.named_parameters()}

    report = qk_clip_(wrapper, TAU)
    assert report["clipped_heads"] == {"attn": [0, 2]} and report["n_clipped"] == 2
    assert report["max_logit"]["attn"] == pytest.approx(before.max().item())

    m(x)
    after = m.max_logit
    assert (after <= TAU * (1 + 1e-5)).all()
    torch.testing.assert_close(after[[0, 2]], torch.full((2,), TAU), rtol=1e-5, atol=0)  # exactly tau, not lower
    torch.testing.assert_close(after[[1, 3]], before[[1, 3]], rtol=0, atol=0)
    # Only the clipped heads' q rows and k_nope rows moved; the shared rotary key, V rows and o_proj did not.
    params = dict(m.named_parameters())
    q_name = "q_proj.weight" if q_lora_rank is None else "q_b_proj.weight"
    q_changed = (params[q_name] != untouched[q_name]).view(H, 12, -1).any(dim=(1, 2))
    assert q_changed.tolist() == [True, False, True, False]
    kv_changed = (params["kv_b_proj.weight"] != untouched["kv_b_proj.weight"]).view(H, 16, -1).any(dim=2)
    assert kv_changed[:, :8].any(dim=1).tolist() == [True, False, True, False]
    assert not kv_changed[:, 8:].any()  # V rows
    for name in ("kv_a_proj.weight", "o_proj.weight"):
        assert torch.equal(params[name], untouched[name])


def test_measurement_is_consumed_and_tracking_off_skips():
    torch.manual_seed(1)
    model = TwoMLA()
    with torch.no_grad():
        model.a.q_proj.weight.mul_(60.0)
    x = torch.randn(1, 8, 32)
    nothing = {"max_logit": {}, "max_logit_head": {}, "clipped_heads": {}, "n_clipped": 0}
    assert qk_clip_(model, TAU) == nothing  # nothing measured
    set_max_logit_tracking(model, True)
    model(x)
    first = qk_clip_(model, TAU)
    assert "a" in first["clipped_heads"] and first["n_clipped"] >= 1
    assert model.a.max_logit is None and model.b.max_logit is None  # consumed by the clip
    weights = model.a.q_proj.weight.clone()
    assert qk_clip_(model, TAU)["n_clipped"] == 0  # no new forward: nothing to clip twice
    assert torch.equal(model.a.q_proj.weight, weights)
    set_max_logit_tracking(model, False)
    assert model.a.max_logit is None and model.b.max_logit is None
    with pytest.raises(ValueError, match="tau"):
        qk_clip_(model, 0.0)


def test_model_level_names():
    torch.manual_seed(2)
    model = KimiK3.from_fields(
        vocab_size=50,
        d_model=32,
        n_layers=2,
        kda_mla_ratio="0:1",
        mla_n_heads=2,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_routed_experts=4,
        expert_ffn_dim=16,
        dense_ffn_dim=32,
    )
    assert set_max_logit_tracking(model, True) == 2
    model(torch.randint(0, 50, (2, 16)))
    report = qk_clip_(model, 1e-3)  # tiny tau: every head clips
    assert set(report["clipped_heads"]) == {"layers.0.mixer", "layers.1.mixer"} and report["n_clipped"] == 4
    assert set(report["max_logit"]) == {"layers.0.mixer", "layers.1.mixer"}


def test_non_finite_measurements_are_reported_never_applied():
    """After an fp16 overflow a head may measure inf: tau / inf = 0 must not wipe its rows."""
    torch.manual_seed(3)
    model = TwoMLA()
    set_max_logit_tracking(model, True)
    model(torch.randn(1, 8, 32))
    model.a.max_logit = torch.tensor([float("inf"), 1.0, float("nan"), 1e6])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = qk_clip_(model, TAU)
    assert "a" not in report["clipped_heads"] and not math.isfinite(report["max_logit"]["a"])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items() if k.startswith("a."))
    assert model.a.max_logit is None


def test_reset_discards_the_measurement_of_a_skipped_update():
    torch.manual_seed(4)
    model = TwoMLA()
    with torch.no_grad():
        model.a.q_proj.weight.mul_(60.0)
    set_max_logit_tracking(model, True)
    model(torch.randn(1, 8, 32))
    assert model.a.max_logit is not None
    reset_max_logits(model)
    assert qk_clip_(model, TAU)["n_clipped"] == 0


def test_eval_forward_does_not_touch_the_measurement():
    torch.manual_seed(5)
    model = TwoMLA()
    set_max_logit_tracking(model, True)
    model.eval()
    model(torch.randn(1, 8, 32))
    assert model.a.max_logit is None and model.b.max_logit is None
