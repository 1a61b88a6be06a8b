"""The K3 health panel (KimiK3.diagnostics, QKClip.metrics) against a direct computation on a small model: each
figure made again from what the layers saw, over a window of two training forwards."""

import math

import pytest
import torch

from k3train.models.k3.model import Block
from k3train.models.k3.moe import MoE
from k3train.models.kda.layer import KimiDeltaAttention
from k3train.runtime.parallel_dims import ParallelDims
from k3train.train.callbacks import QKClip

from helpers.tiny_k3 import batch, tiny_model


def _watch(model):
    """Forward hooks recording each block's output, each KDA layer's input and each MoE's input and bias."""
    seen = {"block": {}, "kda": {}, "moe": {}}
    names = {id(m): i for i, layer in enumerate(model.layers) for m in (layer, layer.mixer, layer.ffn)}

    def after_block(module, args, out):
        seen["block"].setdefault(names[id(module)], []).append(out.detach())

    def before_kda(module, args):
        seen["kda"].setdefault(names[id(module)], []).append(args[0].detach())

    def before_moe(module, args):
        seen["moe"].setdefault(names[id(module)], []).append((args[0].detach(), module.expert_bias.clone()))

    for m in model.modules():
        if isinstance(m, Block):
            m.register_forward_hook(after_block)
        elif isinstance(m, KimiDeltaAttention):
            m.register_forward_pre_hook(before_kda)
        elif isinstance(m, MoE):
            m.register_forward_pre_hook(before_moe)
    return seen


def test_the_panel_equals_a_direct_computation():
    model = tiny_model(kda_gate="sigmoid")
    starved = model.layers[1].ffn  # its expert 0 out of reach: a bias of -10 against scores in (0, 1), held there
    with torch.no_grad():
        starved.expert_bias[0] = -10.0
    starved.balancer.method = "none"
    seen = _watch(model)
    model(*batch(seed=0))
    model(*batch(seed=1))
    panel = model.diagnostics()

    for i, outs in seen["block"].items():  # the residual stream after each layer
        expected = math.sqrt(sum(o.double().square().mean().item() for o in outs) / len(outs))
        assert panel[f"residual/{i}/rms"] == pytest.approx(expected, rel=1e-5)

    assert seen["kda"]
    with torch.no_grad():
        for i, inputs in seen["kda"].items():
            layer = model.layers[i].mixer
            gates = [layer._input_projections(x, fused=False) for x in inputs]
            g = [layer._forget_gate(f_a) for _, f_a, _, _ in gates]
            beta = [b.sigmoid() for _, _, _, b in gates]
            bound = 0.99 * layer.gate_lower_bound
            assert panel[f"kda/{i}/log_decay_min"] == pytest.approx(min(t.min().item() for t in g), rel=1e-6)
            assert panel[f"kda/{i}/log_decay_mean"] == pytest.approx(sum(t.mean().item() for t in g) / 2, rel=1e-5)
            near = sum((t <= bound).double().mean().item() for t in g) / 2
            assert panel[f"kda/{i}/near_lower_bound"] == pytest.approx(near, abs=1e-7)
            assert panel[f"kda/{i}/beta_mean"] == pytest.approx(sum(t.mean().item() for t in beta) / 2, rel=1e-5)

    dead_somewhere = False
    with torch.no_grad():
        for i, passes in seen["moe"].items():
            moe = model.layers[i].ffn
            load = torch.zeros(moe.n_experts)
            for x, bias in passes:  # the routing each forward made, with the bias it had then
                scores = moe.router.scores(moe.router.logits(x.reshape(-1, x.shape[-1])))
                chosen = moe.router.choose(scores, bias)
                load += torch.bincount(chosen.flatten(), minlength=moe.n_experts)
            dead = (load == 0).double().mean().item()
            dead_somewhere |= dead > 0
            assert panel[f"moe/{i}/dead_share"] == dead
            assert panel[f"moe/{i}/load_cv"] == pytest.approx((load.std(correction=0) / load.mean()).item(), rel=1e-5)
            drift = (moe.expert_bias - passes[0][1]).abs().max().item()
            assert panel[f"moe/{i}/bias_drift"] == pytest.approx(drift, rel=1e-6)
    assert dead_somewhere, "no idle expert: the dead-expert share was not put to the test"

    # the next read is a new window: nothing has run since
    assert not any(key.startswith(("kda/", "residual/")) for key in model.diagnostics())


def test_qk_clip_reports_the_window_max_logit_and_its_head():
    """Each update's per-head max (the measurement test_mla.py checks against brute force); the window keeps the
    largest over its updates and the head it was in."""
    model = tiny_model()
    callback = QKClip(tau=1e6)  # measure, never clip
    callback.setup(model, torch.optim.SGD(model.parameters(), lr=0.0), ParallelDims(device_type="cpu"))
    mla = {name: m for name, m in model.named_modules() if hasattr(m, "track_max_logit")}
    assert mla
    per_update = []
    for seed in (0, 3):
        model(*batch(seed=seed))
        per_update.append({name: m.max_logit.clone() for name, m in mla.items()})
        callback.after_optimizer_step(seed)
    figures = callback.metrics()
    for name in mla:
        heads = torch.stack([update[name] for update in per_update]).amax(dim=0)  # [H] over the window
        assert figures["max_logit"][name] == heads.max().item()
        assert figures["max_logit_head"][name] == int(heads.argmax())
