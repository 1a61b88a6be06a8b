"""model.parametrization=mup (k3train/models/k3/mup.py, k3train/optim/mup.py): the coordinate check that CI runs,
mup equal to standard at its base, each rule's factor, and what a mup model does outside training (a pipeline
stage, a Hugging Face export)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from k3train.data.tokenizers import ByteTokenizer
from k3train.hf.read import read_hf
from k3train.hf.write import write_hf
from k3train.models.k3 import KimiK3
from k3train.models.k3.config import KimiK3Config
from k3train.models.k3.hf_config import NotExpressible
from k3train.models.k3.state_dict_adapter import HF_ADAPTER
from k3train.mup_check import coordinate_check, family_config, member
from k3train.optim.build import adamw, muon_adamw
from k3train.optim.muon import MuonAdamW
from k3train.optim.param_groups import partition_parameters

MUON = dict(
    lr=3e-3,
    weight_decay=0.1,
    betas=(0.9, 0.95),
    eps=1e-8,
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    rms_match=0.2,
    head_wise=True,
    orthogonality_check_interval=50,
    ns_dtype="fp32",
)


@pytest.fixture(scope="module")
def tiny() -> KimiK3Config:
    return family_config("k3_tiny")  # d_model 128, 4 layers: mup's default base


def build(config: KimiK3Config, seed: int = 0, **changes) -> KimiK3:
    torch.manual_seed(seed)
    return KimiK3(dataclasses.replace(config, **changes))


def test_coordinate_check_mup_keeps_every_layer_type_within_2x_over_8x_width_and_standard_does_not(tiny) -> None:
    # The check: activation RMS after 3 updates, 4 widths spanning 8x. Standard is measured beside it so
    # that the check is seen to fail where muP is off.
    result = coordinate_check([tiny.at_width(w) for w in (32, 64, 128, 256)], steps=3, lr=1e-2)
    mup, standard = result["spread"]["mup"], result["spread"]["standard"]
    assert set(mup) == {"embedding", "kda", "mla", "dense_ffn", "moe", "logits"}
    assert max(mup.values()) < 2.0, mup
    assert max(standard.values()) > 2.0, standard
    # the change since init (feature learning) is of one size too, and not zero
    last = [result["delta_rms"]["mup"][w][-1] for w in result["sizes"]]
    for kind in ("kda", "mla", "moe", "logits"):
        values = [r[kind] for r in last]
        assert min(values) > 0 and max(values) / min(values) < 2.0, (kind, values)


def test_depth_coordinate_check_without_attention_residuals_uses_the_branch_multiplier() -> None:
    linear = family_config("kimi_linear_tiny")
    assert linear.attn_res_block_size is None
    result = coordinate_check([member(linear, "n_layers", n) for n in (2, 4, 8, 16)], "n_layers", steps=3, lr=1e-2)
    assert max(result["spread"]["mup"].values()) < 2.0, result["spread"]
    assert max(result["spread"]["standard"].values()) > 2.0, result["spread"]


def test_at_its_base_mup_is_standard_bitwise_weights_and_updates(tiny) -> None:
    x = torch.randint(0, 257, (2, 32))
    models = [build(tiny, parametrization=p) for p in ("standard", "mup")]
    for a, b in zip(*(m.state_dict().values() for m in models)):
        assert torch.equal(a, b)
    for model in models:
        optimizer = muon_adamw(model, **MUON)
        assert all("lr_scales" not in g for g in optimizer.param_groups)  # every factor is 1
        _, loss = model(x, x)
        loss.backward()
        optimizer.step()
    for a, b in zip(*(m.state_dict().values() for m in models)):
        assert torch.equal(a, b)


def test_init_follows_the_spectral_condition_against_the_base(tiny) -> None:
    wide = build(tiny.at_width(512), parametrization="mup")  # m = 4
    stds = {name: rule.std for name, rule in wide.init_rules().items() if hasattr(rule, "std")}
    base = tiny.init_std
    assert stds["embed_tokens.weight"] == base and stds["lm_head.weight"] == base  # the multiplier scales logits
    assert math.isclose(stds["layers.1.ffn.shared.w_up.weight"], base / 2)  # square-ish: 1/sqrt(m)
    assert math.isclose(stds["layers.1.ffn.router.weight"], base / 4)  # fan_out stays: 1/m
    residual = base / math.sqrt(2 * tiny.mup_base_depth) / 2  # at the base depth, then 1/sqrt(m)
    assert math.isclose(stds["layers.1.ffn.experts.w_down"], residual)
    assert wide.output_multiplier == 0.25


def test_lr_factors_per_rule(tiny) -> None:
    wide = build(tiny.at_width(512), parametrization="mup")
    factors = {a.name: a.lr_scale for a in partition_parameters(wide)}
    assert factors["embed_tokens.weight"] == factors["lm_head.weight"] == 1.0
    assert factors["layers.0.mixer_norm.weight"] == 1.0
    assert math.isclose(factors["layers.0.mixer.q_proj.weight"], 1 / 4)  # heads split by rows: 1/m
    assert math.isclose(factors["layers.0.mixer.o_proj.weight"], 1 / 4)  # by columns: 1/m too
    assert math.isclose(factors["layers.1.ffn.shared.w_up.weight"], 1 / 2)  # a whole matrix: 1/sqrt(m)
    assert math.isclose(factors["layers.1.ffn.experts.w_up"], 1 / 2)  # each expert a matrix
    assert math.isclose(factors["layers.1.ffn.router.weight"], 1 / 4)  # AdamW: fan_in0 / fan_in
    assert factors["layers.0.mixer.f_b_proj.weight"] == 1.0  # AdamW, fan_in the gate's fixed rank
    # the AdamW baseline takes AdamW's factor for every matrix, in groups of one lr each
    groups = {g["name"]: g for g in adamw(wide, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8).param_groups}
    assert {"decay", "decay_x0.25", "no_decay"} <= set(groups)
    assert math.isclose(groups["decay_x0.25"]["lr"], 2.5e-4)
    q = dict(wide.named_parameters())["layers.0.mixer.q_proj.weight"]
    assert any(p is q for p in groups["decay_x0.25"]["params"])


def test_a_params_lr_scale_scales_its_update_and_leaves_its_weight_decay() -> None:
    torch.manual_seed(0)
    for kind in ("muon", "adamw"):
        w, v = torch.nn.Parameter(torch.randn(16, 8)), None
        v = torch.nn.Parameter(w.detach().clone())
        scaled = MuonAdamW([dict(name="g", kind=kind, params=[w], lr_scales=[0.25])], lr=0.1, weight_decay=0.0)
        plain = MuonAdamW([dict(name="g", kind=kind, params=[v], lr=0.025)], lr=0.1, weight_decay=0.0)
        g = torch.randn(16, 8)
        w.grad, v.grad = g.clone(), g.clone()
        scaled.step(), plain.step()
        assert torch.equal(w, v), kind  # the update at lr * factor
    # the decay a step is the group's lr * wd whatever the factor, as the mup package's MuAdam keeps it
    p = torch.nn.Parameter(torch.ones(4, 4))
    decayed = MuonAdamW([dict(name="g", kind="adamw", params=[p], lr_scales=[0.25])], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(4, 4)
    decayed.step()
    assert torch.equal(p, torch.full((4, 4), 1 - 0.1 * 0.5))
    with pytest.raises(ValueError, match="lr_scales must be 1 finite"):
        MuonAdamW([dict(name="g", kind="muon", params=[p], lr_scales=[0.0])])


def test_adamws_factors_are_the_mup_packages_where_both_dims_grow_and_tp5s_for_output_like_matrices(tiny) -> None:
    mup_package = pytest.importorskip("mup", reason="the comparison needs the mup package (pip install mup)")
    wide = build(tiny.at_width(512), parametrization="mup")
    base = build(wide.config.mup_base())
    # do_assert=False: the package asks that every matrix with a fixed fan_out be its MuReadout (see below)
    mup_package.set_base_shapes(wide, base, rescale_params=False, do_assert=False)
    factors = {a.name: a.lr_scale for a in partition_parameters(wide, muon=False)}
    params = dict(wide.named_parameters())
    checked = 0
    for name, factor in factors.items():
        infshape = params[name].infshape
        if name in ("embed_tokens.weight", "lm_head.weight") or infshape.ninf() < 2:
            # MuAdam's vector-like: factor 1, except a matrix whose fan_in grows into a fixed fan_out (a router, a
            # residual query, a gate's first projection), which TP5 gives 1/fan_in and MuAdam leaves to MuReadout
            output_like = params[name].ndim >= 2 and name not in ("embed_tokens.weight", "lm_head.weight")
            output_like = output_like and infshape[-1].isinf() and not infshape[-2].isinf()
            assert factor == (1 / infshape[-1].width_mult() if output_like else 1.0), name
        else:
            assert math.isclose(factor, 1 / infshape.width_mult()), name  # MuAdam: lr / width_mult
            checked += 1
    assert checked > 30


def test_a_pipeline_stage_applies_the_output_multiplier(tiny) -> None:
    model = build(tiny.at_width(64), parametrization="mup", tie_embeddings=False).eval()  # routing bias stays
    x = torch.randint(0, 257, (2, 24))
    _, loss = model(x, x)
    stage = model.pipeline_stage(0, tiny.n_layers)
    assert torch.equal(stage(x, targets=x)[0], loss)
    # a pipelined run optimises its stages as one ModuleList: each stage's parameters keep the whole model's factors
    stages = torch.nn.ModuleList([model.pipeline_stage(0, 2), model.pipeline_stage(2, tiny.n_layers)])
    whole = {a.name: a.lr_scale for a in partition_parameters(model)}
    got = {a.name.split(".", 1)[1]: a.lr_scale for a in partition_parameters(stages)}
    assert got == whole and max(whole.values()) > 1  # narrower than the base: larger lrs


def test_a_hugging_face_export_folds_the_output_multiplier_into_the_final_norm(tiny, tmp_path) -> None:
    model = build(tiny.at_width(64), parametrization="mup")
    x = torch.randint(0, 257, (1, 20))
    write_hf(HF_ADAPTER, model, ByteTokenizer(), tmp_path / "hf", shard_bytes=10**9)
    back = read_hf(HF_ADAPTER, tmp_path / "hf", say=lambda _: None).model
    assert back.config.parametrization == "standard"
    torch.testing.assert_close(back(x)[0], model(x)[0], rtol=1e-5, atol=1e-6)
    linear = family_config("kimi_linear_tiny")
    deeper = build(member(linear, "n_layers", 8), parametrization="mup")  # a branch multiplier of 1/2
    with pytest.raises(NotExpressible, match="multiplies each residual branch"):
        write_hf(HF_ADAPTER, deeper, ByteTokenizer(), tmp_path / "refused", shard_bytes=10**9)
    assert not (tmp_path / "refused").exists()


def test_widths_that_do_not_scale_to_the_base_are_refused_naming_the_field(tiny) -> None:
    with pytest.raises(ValueError, match=r"mup_base_width=43: mla_n_heads=4 at d_model=128 scales to 1\.34375"):
        dataclasses.replace(tiny, parametrization="mup", mup_base_width=43)
    with pytest.raises(ValueError, match="parametrization='bogus' must be one of"):
        dataclasses.replace(tiny, parametrization="bogus")


def test_mup_fields_leave_a_standard_architecture_as_it_was(tiny) -> None:
    # checkpoints written before the fields existed still match a standard model's architecture
    assert "parametrization" not in tiny.architecture()
    assert dataclasses.replace(tiny, parametrization="mup").architecture()["mup_base_width"] == 128
