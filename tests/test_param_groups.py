"""The Muon/AdamW partition: every parameter where the rules say, exactly once; the Hydra targets build from it."""

from __future__ import annotations

import copy
from pathlib import Path

import hydra
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from k3train.models.layout import ParamLayout, parameter_layouts
from k3train.optim.muon import MuonAdamW
from k3train.optim.param_groups import check_partition, partition_parameters
from k3train.optim.summary import format_param_groups

from helpers.config import MODEL_BASES, model_config

CONF = Path(__file__).resolve().parents[1] / "conf"
D, H, DH, E, F = 16, 4, 8, 3, 24


class FakeKDA(nn.Module):
    """The parameter names and shapes of k3train/models/kda/layer.py (docs/contracts.md), no forward."""

    def __init__(self) -> None:
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, nn.Linear(D, H * DH, bias=False))
        for name in ("q_conv", "k_conv", "v_conv"):
            setattr(self, name, nn.Conv1d(H * DH, H * DH, 4, groups=H * DH, bias=False))  # weight [C, 1, 4]
        self.f_a_proj, self.f_b_proj = nn.Linear(D, DH, bias=False), nn.Linear(DH, H * DH, bias=False)
        self.g_a_proj, self.g_b_proj = nn.Linear(D, DH, bias=False), nn.Linear(DH, H * DH, bias=True)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.A_log, self.dt_bias = nn.Parameter(torch.zeros(H)), nn.Parameter(torch.zeros(H * DH))
        self.o_norm = nn.RMSNorm(DH)
        self.o_proj = nn.Linear(H * DH, D, bias=False)

    def param_layouts(self) -> dict[str, ParamLayout]:
        rows = {f"{name}.weight": ParamLayout(head_split=(H, 0)) for name in ("q_proj", "k_proj", "v_proj")}
        return {**rows, "o_proj.weight": ParamLayout(head_split=(H, 1))}


class FakeMLA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_a_proj, self.q_a_norm, self.q_b_proj = (
            nn.Linear(D, 12, bias=False),
            nn.RMSNorm(12),
            nn.Linear(12, H * DH),
        )
        self.kv_a_proj, self.kv_a_norm = nn.Linear(D, 10, bias=False), nn.RMSNorm(8)
        self.kv_b_proj = nn.Linear(8, H * 2 * DH, bias=False)
        self.o_proj = nn.Linear(H * DH, D, bias=False)

    def param_layouts(self) -> dict[str, ParamLayout]:
        rows = {name: ParamLayout(head_split=(H, 0)) for name in ("q_b_proj.weight", "kv_b_proj.weight")}
        return {**rows, "o_proj.weight": ParamLayout(head_split=(H, 1))}


class FakeMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.Module()
        self.experts.w_gate, self.experts.w_up = nn.Parameter(torch.randn(E, F, D)), nn.Parameter(torch.randn(E, F, D))
        self.experts.w_down = nn.Parameter(torch.randn(E, D, F))
        self.shared = nn.Module()
        self.shared.w_gate, self.shared.w_down = nn.Linear(D, F, bias=False), nn.Linear(F, D, bias=False)


class FakeModel(nn.Module):
    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, D)
        self.layers = nn.ModuleList([FakeKDA(), FakeMLA()])
        self.moe, self.norm = FakeMoE(), nn.RMSNorm(D)
        self.lm_head = nn.Linear(D, 50, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight
        self.frozen = nn.Parameter(torch.zeros(D, D), requires_grad=False)


EXPECTED = {  # name -> (group, view)
    "embed.weight": ("adamw_embed", "elementwise"),
    "lm_head.weight": ("adamw_embed", "elementwise"),
    "norm.weight": ("adamw_no_decay", "elementwise"),
    **{f"layers.0.{n}_proj.weight": ("muon_attention", "heads(4, dim=0)") for n in "qkv"},
    "layers.0.o_proj.weight": ("muon_attention", "heads(4, dim=1)"),
    **{f"layers.0.{n}_conv.weight": ("adamw_aux", "elementwise") for n in "qkv"},
    **{
        f"layers.0.{n}.weight": ("adamw_aux", "elementwise")
        for n in ("f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "b_proj")
    },
    "layers.0.g_b_proj.bias": ("adamw_no_decay", "elementwise"),
    "layers.0.A_log": ("adamw_no_decay", "elementwise"),
    "layers.0.dt_bias": ("adamw_no_decay", "elementwise"),
    "layers.0.o_norm.weight": ("adamw_no_decay", "elementwise"),
    "layers.1.q_a_proj.weight": ("muon_attention", "matrix"),
    "layers.1.q_a_norm.weight": ("adamw_no_decay", "elementwise"),
    "layers.1.q_b_proj.weight": ("muon_attention", "heads(4, dim=0)"),
    "layers.1.q_b_proj.bias": ("adamw_no_decay", "elementwise"),
    "layers.1.kv_a_proj.weight": ("muon_attention", "matrix"),
    "layers.1.kv_a_norm.weight": ("adamw_no_decay", "elementwise"),
    "layers.1.kv_b_proj.weight": ("muon_attention", "heads(4, dim=0)"),
    "layers.1.o_proj.weight": ("muon_attention", "heads(4, dim=1)"),
    "moe.router.weight": ("adamw_aux", "elementwise"),
    **{f"moe.experts.{n}": ("muon_experts", "experts(3)") for n in ("w_gate", "w_up", "w_down")},
    "moe.shared.w_gate.weight": ("muon_ffn", "matrix"),
    "moe.shared.w_down.weight": ("muon_ffn", "matrix"),
}


def test_partition_follows_the_rules() -> None:
    assignments = partition_parameters(FakeModel())
    assert {a.name: (a.group, a.view) for a in assignments} == EXPECTED  # the frozen parameter is left out
    by_name = {a.name: a for a in assignments}
    assert not by_name["layers.0.A_log"].weight_decay and by_name["embed.weight"].weight_decay
    assert by_name["layers.0.o_proj.weight"].head_split == (H, 1) and by_name["moe.experts.w_up"].kind == "muon"
    assert all(a.reason for a in assignments)


def test_head_wise_off_gives_whole_matrices() -> None:
    for a in partition_parameters(FakeModel(), head_wise=False):
        assert a.head_split is None and not a.view.startswith("heads")
        assert a.group == EXPECTED[a.name][0]


def test_head_splits_are_the_modules_layouts_and_survive_a_copy() -> None:
    """The layout table is read from modules and names, so a copy of the model (or FSDP2's new DTensor parameters,
    tests/test_fsdp.py) is partitioned as the original; a tensor attribute did not survive copy.deepcopy."""
    model = FakeModel()
    original = {a.name: a.view for a in partition_parameters(model)}
    assert {a.name: a.view for a in partition_parameters(copy.deepcopy(model))} == original
    assert parameter_layouts(model)["layers.1.q_b_proj.weight"].head_split == (H, 0)


def test_a_head_split_that_does_not_fit_its_weight_is_an_error() -> None:
    model = FakeModel()
    model.layers[1].param_layouts = lambda: {"o_proj.weight": ParamLayout(head_split=(3, 1))}  # 32 columns, 3 heads
    with pytest.raises(ValueError, match="layers.1.o_proj.weight: head_split=\\(3, 1\\) does not fit"):
        partition_parameters(model)


def test_tied_weights_are_counted_once() -> None:
    model = FakeModel(tie=True)
    names = [a.name for a in partition_parameters(model)]
    assert "lm_head.weight" not in names and names.count("embed.weight") == 1
    check_partition(model, _muon_adamw(model).param_groups)


def test_broken_partition_is_rejected_by_name() -> None:
    model = FakeModel()
    groups = [dict(g) for g in _muon_adamw(model).param_groups]
    check_partition(model, groups)
    dropped = [dict(g, params=[p for p in g["params"] if p is not model.layers[0].A_log]) for g in groups]
    with pytest.raises(ValueError, match=r"layers\.0\.A_log is in no group"):
        check_partition(model, dropped)
    doubled = groups + [dict(name="extra", params=[model.moe.router.weight])]
    with pytest.raises(ValueError, match=r"moe\.router\.weight is in both 'adamw_aux' and 'extra'"):
        check_partition(model, doubled)
    with pytest.raises(ValueError, match="not a trainable parameter"):
        check_partition(model, groups + [dict(name="extra", params=[model.frozen])])


def test_parameter_fitting_no_rule_is_an_error() -> None:
    model = FakeModel()
    model.odd = nn.Parameter(torch.zeros(2, 2, 2, 2))
    with pytest.raises(ValueError, match="parameter odd with shape"):
        partition_parameters(model)


def _muon_adamw(model: nn.Module) -> MuonAdamW:
    cfg = OmegaConf.load(CONF / "optim" / "muon_adamw.yaml")
    return hydra.utils.instantiate(cfg)(model)


def test_yaml_targets_build_named_groups() -> None:
    model = FakeModel()
    opt = _muon_adamw(model)
    assert isinstance(opt, MuonAdamW)
    assert [g["name"] for g in opt.param_groups] == [
        "muon_attention",
        "muon_ffn",
        "muon_experts",
        "adamw_embed",
        "adamw_aux",
        "adamw_no_decay",
    ]
    assert all(g["initial_lr"] == g["lr"] == 3e-3 for g in opt.param_groups)
    assert opt.param_groups[-1]["weight_decay"] == 0.0 and opt.param_groups[0]["weight_decay"] == 0.1
    table = format_param_groups(opt.param_groups)
    assert "muon_attention" in table and "nesterov" in table and "betas=(0.9, 0.95)" in table

    baseline = hydra.utils.instantiate(OmegaConf.load(CONF / "optim" / "adamw.yaml"))(model)
    assert isinstance(baseline, torch.optim.AdamW)
    assert [(g["name"], g["weight_decay"], g["initial_lr"]) for g in baseline.param_groups] == [
        ("decay", 0.1, 3e-3),
        ("no_decay", 0.0, 3e-3),
    ]
    no_decay = {id(p) for p in baseline.param_groups[1]["params"]}
    assert no_decay == {id(a.param) for a in partition_parameters(model) if not a.weight_decay}
    assert "no_decay" in format_param_groups(baseline.param_groups)


@pytest.mark.parametrize(
    "path", [p for p in sorted((CONF / "model").glob("*.yaml")) if p.stem not in MODEL_BASES], ids=lambda p: p.stem
)
def test_partition_complete_and_disjoint_for_every_model_config(path: Path) -> None:
    cfg = model_config(path.stem)
    cfg.vocab_size = 64
    with torch.device("meta"):  # names, shapes and annotations are all a partition reads: k3_small allocates nothing
        model = hydra.utils.instantiate(cfg)
    opt = _muon_adamw(model)  # checks completeness and disjointness while building
    check_partition(model, opt.param_groups)
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )


def test_the_optimizer_summary_reads_any_torch_optimizer() -> None:
    """SGD's groups have no betas or eps: the summary shows what each group has, JSON-able, initial lr first."""
    import json

    from k3train.optim.summary import summarize_param_groups

    sgd = torch.optim.SGD(FakeModel().parameters(), lr=0.5, momentum=0.9, nesterov=True)
    rows = summarize_param_groups(sgd.param_groups)
    assert rows[0]["initial_lr"] == 0.5 and rows[0]["momentum"] == 0.9 and rows[0]["nesterov"] is True
    assert "foreach" not in rows[0] and "maximize" not in rows[0]  # implementation flags and False flags are left out
    json.dumps(rows)
    assert "lr=0.5 momentum=0.9 dampening=0 weight_decay=0 nesterov" in format_param_groups(sgd.param_groups)


def test_kimi_k3_components_are_partitioned_as_k3_trains_them() -> None:
    """Gates with heads go to Muon per head, the latent projections to Muon whole, the [1, d] mixing projections
    and every norm to AdamW."""
    cfg = model_config("k3_tiny")
    cfg.vocab_size = 64
    with torch.device("meta"):
        model = hydra.utils.instantiate(cfg)
    by_name = {a.name: a for a in partition_parameters(model)}
    kda, mla, moe = "layers.0.mixer", "layers.3.mixer", "layers.1.ffn"
    assert (by_name[f"{kda}.g_proj.weight"].group, by_name[f"{kda}.g_proj.weight"].view) == (
        "muon_attention",
        f"heads({cfg.kda_n_heads}, dim=0)",
    )
    assert (by_name[f"{mla}.g_proj.weight"].group, by_name[f"{mla}.g_proj.weight"].view) == (
        "muon_attention",
        f"heads({cfg.mla_n_heads}, dim=0)",
    )
    for name in (f"{moe}.latent_down.weight", f"{moe}.latent_up.weight"):
        assert (by_name[name].group, by_name[name].view) == ("muon_ffn", "matrix"), name
    for name in (
        "layers.1.self_attention_res_proj.weight",
        "layers.1.mlp_res_proj.weight",
        "output_attn_res_proj.weight",
    ):
        assert by_name[name].group == "adamw_aux", name
    for name in (f"{moe}.latent_norm.weight", "layers.1.mlp_res_norm.weight", "output_attn_res_norm.weight"):
        assert by_name[name].group == "adamw_no_decay", name
