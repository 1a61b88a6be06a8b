"""Activation checkpointing (KimiK3.set_activation_checkpointing, train.activation_checkpointing): block and selective
give the losses, gradients and Quantile-Balancing biases of no checkpointing (the routing a recomputed Block replays
is its forward's, and the bias moves once per forward), over several updates with gradient accumulation."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_k3 import TINY, batch, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

K3_PARTS = dict(
    attn_res_block_size=2, ffn_activation="situ", expert_latent_dim=16, mla_output_gate=True,
    kda_output_gate="full_rank", kda_gate="sigmoid",
)  # fmt: skip


def train(mode: str, fields: dict, steps: int = 3, accum: int = 2) -> tuple[list[float], dict, dict]:
    """Losses of `steps` AdamW updates of `accum` micro-batches each; then the last gradients and the state."""
    model = tiny_model(0, **fields).double()
    model.set_activation_checkpointing(mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        for micro in range(accum):
            x, y = batch(B=2, T=24, seed=10 * step + micro)
            _, loss = model(x, targets=y)
            (loss / accum).backward()
            losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return losses, grads, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fields", [{}, K3_PARTS], ids=["kimi_linear_form", "k3_form"])
@pytest.mark.parametrize("mode", ["block", "selective"])
def test_checkpointing_changes_nothing_but_memory(mode: str, fields: dict) -> None:
    want_losses, want_grads, want_state = train("none", fields)
    losses, grads, state = train(mode, fields)
    assert losses == pytest.approx(want_losses, rel=1e-6, abs=0)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-12, msg=name)
    for name, t in want_state.items():  # the weights after the updates, and the router biases
        torch.testing.assert_close(state[name], t, rtol=1e-6, atol=1e-12, msg=name)
    assert any(k.endswith("expert_bias") and t.abs().max() > 0 for k, t in state.items())  # balancing did move


def test_a_recomputed_block_replays_its_forwards_routing_and_moves_the_bias_once(monkeypatch) -> None:
    from k3train.models.k3.moe import MoE

    model = tiny_model(0, **K3_PARTS)
    model.set_activation_checkpointing("block")
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    updates = []
    original = MoE._after_training_route
    monkeypatch.setattr(MoE, "_after_training_route", lambda self, *a: (updates.append(self), original(self, *a)))
    x, y = batch(B=2, T=24)
    _, loss = model(x, targets=y)
    bias_after_forward = moe.expert_bias.clone()
    loss.backward()  # recomputes every Block
    assert len(updates) == len([m for m in model.modules() if isinstance(m, MoE)])  # once per MoE, not twice
    assert torch.equal(moe.expert_bias, bias_after_forward) and moe.routes is None


def test_unknown_modes_are_refused() -> None:
    from k3train.config import TrainConfig

    with pytest.raises(ValueError, match="activation checkpointing 'layer' must be one of"):
        tiny_model().set_activation_checkpointing("layer")
    with pytest.raises(ValueError, match="train.activation_checkpointing must be none, block or selective"):
        TrainConfig(activation_checkpointing="all")
    assert TINY  # the shared tiny model: every kind of part


@pytest.mark.slow  # seconds: a subprocess, transformers' import or a whole run built
def test_the_run_sets_it_from_the_config_and_refuses_a_model_without_it(monkeypatch, tmp_path, tiny_data_dir) -> None:
    from helpers.config import built_run

    _, parts = built_run(
        monkeypatch, tmp_path / "run", tiny_data_dir, "train.activation_checkpointing=selective", model="k3_tiny"
    )
    trainer = parts["trainer"]
    assert {layer.checkpointing for layer in trainer.model.layers} == {"selective"}
    trainer.train_step()
    assert trainer.state.step == 1
    with pytest.raises(ValueError, match="SmokeTestLM has no checkpointing; use none"):
        built_run(monkeypatch, tmp_path / "smoke", tiny_data_dir, "train.activation_checkpointing=block")
