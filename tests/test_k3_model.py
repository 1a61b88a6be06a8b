"""KimiK3: config validation, the seeds' tiny-model integration checks, check_data, parameter counts, YAML configs."""

from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from k3train.models.k3 import KimiK3, KimiK3Config
from k3train.models.k3.moe import MoE

from helpers.config import model_config
from helpers.tiny_k3 import V, batch, tiny_model

# A tiny model runs hundreds of tiny ops a step: with a thread pool each waits for both threads, and one thread
# descheduled by another busy process stalls them all (measured: the memorisation test took 32 s instead of 2.5 s
# beside a busy process with spinning OpenMP threads).
pytestmark = pytest.mark.usefixtures("one_thread")

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"
# --- config -------------------------------------------------------------------------------------------------------


def test_explicit_layer_types_from_yaml_become_a_plain_list():
    cfg = model_config("k3_tiny")  # composed: the file is k3_base plus its sizes
    cfg.vocab_size, cfg.kda_mla_ratio, cfg.layer_types = V, None, ["mla", "kda", "kda", "mla"]
    model = instantiate(cfg)
    assert type(model.config.layer_types) is list
    assert [layer.mixer_type for layer in model.layers] == ["mla", "kda", "kda", "mla"]


def test_layer_patterns():
    assert KimiK3Config(n_layers=8, kda_mla_ratio="3:1").layer_pattern == ["kda"] * 3 + ["mla"] + ["kda"] * 3 + ["mla"]
    kimi_linear = KimiK3Config(n_layers=27, kda_mla_ratio="3:1").layer_pattern  # MLA at 4, 8, ..., 24, 27 (1-based)
    assert [i + 1 for i, t in enumerate(kimi_linear) if t == "mla"] == [4, 8, 12, 16, 20, 24, 27]
    assert KimiK3Config(n_layers=3, kda_mla_ratio="0:1").layer_pattern == ["mla"] * 3
    explicit = KimiK3Config(n_layers=3, kda_mla_ratio=None, layer_types=["mla", "kda", "mla"])
    assert explicit.layer_pattern == ["mla", "kda", "mla"]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(n_layers=3, kda_mla_ratio=None, layer_types=["kda", "mla"]), "n_layers=3"),
        (dict(layer_types=["kda"] * 4), "not both"),
        (dict(kda_mla_ratio=None, layer_types=["kda", "attn", "kda", "mla"]), "attn"),
        (dict(kda_mla_ratio=181), "quote it in YAML"),
        (dict(experts_per_token=8, n_routed_experts=8), "experts_per_token"),
        (dict(router="aux_loss"), "router"),
        (dict(kda_implementation="cuda"), "kda_implementation"),
        (dict(d_model=0), "d_model"),
        (dict(mla_rope=True, qk_rope_head_dim=5), "qk_rope_head_dim"),
        (dict(first_k_dense=9), "first_k_dense"),
        (dict(kda_chunk_size=48), "power of two"),
    ],
)
def test_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        KimiK3Config(**fields)


def test_model_needs_a_vocab_size():
    with pytest.raises(ValueError, match="vocab_size"):
        KimiK3(KimiK3Config())


# --- the seeds' tiny-model integration checks ----------------------------------------------------------------------


def test_forward_shapes_and_fp32_loss():
    model = tiny_model()
    x, y = batch()
    no_logits, loss = model(x, y)  # with targets the head and the loss run fused: no logits
    assert no_logits is None and loss.dtype == torch.float32 and loss.ndim == 0
    logits, no_loss = model(x)
    assert logits.shape == (4, 32, V) and no_loss is None
    manual = torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(), y.reshape(-1))
    torch.testing.assert_close(loss, manual)
    assert abs(loss.item() - torch.log(torch.tensor(float(V))).item()) < 0.5  # near-uniform at init


def test_next_token_alignment():
    """Logits at position t depend on tokens <= t only (T=40 is not a multiple of kda_chunk_size=16: the padded
    tail is exercised too)."""
    model = tiny_model().eval()
    x, _ = batch(B=2, T=40)
    logits, _ = model(x)
    for t in (0, 15, 16, 30):
        x2 = x.clone()
        x2[:, t + 1 :] = (x2[:, t + 1 :] + 1 + torch.arange(40 - t - 1)) % V
        logits2, _ = model(x2)
        torch.testing.assert_close(logits2[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-5)
        if t < 39:
            assert (logits2[:, t + 1 :] - logits[:, t + 1 :]).abs().max() > 1e-4


def test_every_parameter_gets_a_gradient_and_changes_after_one_update():
    model = tiny_model()
    x, y = batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, loss = model(x, y)
    loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not no_grad, f"parameters with no gradient: {no_grad}"
    # routed experts are one parameter per layer: check each expert's own slice got gradient
    for i, moe in model.moe_layers().items():
        idle = [e for e in range(moe.n_experts) if moe.experts.w_down.grad[e].abs().sum() == 0]
        assert not idle, f"layer {i}: experts {idle} got no tokens in this batch"
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert not unchanged, f"parameters unchanged by one AdamW step: {unchanged}"


def test_memorises_a_fixed_batch():
    model = tiny_model()
    x, y = batch(B=2, T=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Random targets over 61 tokens start at ~ln(61) = 4.1; measured at seed 0: 0.27 after 20 steps, 0.016 after 35.
    assert losses[0] > 3.5 and min(losses[-5:]) < 0.1, losses[::10]


def test_eval_forward_leaves_mode_rng_and_router_state():
    model = tiny_model()
    x, y = batch()
    model(x, y)  # one training pass: router biases and diagnostics are now set
    model.eval()
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    assert len(biases) == 3 and any(b.abs().sum() > 0 for b in biases.values())
    model.diagnostics()  # the training pass's window read: what is left is the last training pass's router figures
    diagnostics = model.diagnostics()
    assert diagnostics and all(key.startswith("moe/") for key in diagnostics)
    rng = torch.get_rng_state()
    with torch.no_grad():
        model(x, y)
    assert all(not m.training for m in model.modules())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(b, biases[n]) for n, b in model.named_buffers() if n in biases)
    assert model.diagnostics() == diagnostics  # the eval forward measured nothing
    model.train()
    model(x, y)
    assert any(not torch.equal(b, biases[n]) for n, b in model.named_buffers() if n in biases)


def test_state_dict_round_trip_includes_router_bias():
    model = tiny_model()
    model(*batch())
    state = model.state_dict()
    assert sum(k.endswith("expert_bias") for k in state) == 3
    other = tiny_model(seed=1)
    other.load_state_dict(state)
    x, _ = batch(seed=3)
    torch.testing.assert_close(other.eval()(x)[0], model.eval()(x)[0])


# --- check_data, diagnostics, counts -------------------------------------------------------------------------------


def test_check_data():
    model = tiny_model()
    model.check_data(V, 64)
    model.check_data(V, 40)  # not a multiple of kda_chunk_size: fine, the chunk path pads its tail
    with pytest.raises(ValueError, match="vocab_size=null"):
        model.check_data(V + 1, 32)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.check_data(V, 65)


def test_diagnostics_keys():
    model = tiny_model()
    assert model.diagnostics() == {}
    model(*batch())
    diag = model.diagnostics()
    router = ("load_max", "load_min", "bias_range", "routing_entropy", "load_cv", "dead_share", "bias_drift")
    kda = [i for i, layer in enumerate(model.layers) if layer.mixer_type == "kda"]
    gates = ("log_decay_mean", "log_decay_min", "beta_mean") + (
        ("near_lower_bound",) if model.config.kda_gate == "sigmoid" else ()
    )
    assert set(diag) == (
        {f"moe/{i}/{s}" for i in (1, 2, 3) for s in router}
        | {f"kda/{i}/{s}" for i in kda for s in gates}
        | {f"residual/{i}/rms" for i in range(len(model.layers))}
    )
    assert kda and all(isinstance(v, float) for v in diag.values())


def test_param_counts():
    model = tiny_model()
    counts = model.param_counts()
    per_expert = 3 * 32 * 16
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["total"] - counts["active"] == 3 * (4 - 2) * per_expert  # 3 MoE layers, 2 idle experts each
    assert counts["embedding"] == V * 32
    tied = tiny_model(tie_embeddings=True)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert tied.param_counts()["total"] == counts["total"] - V * 32


@pytest.mark.parametrize("name", ["k3_tiny", "k3_small", "k3_mla_only"])
def test_model_yamls_instantiate(name):
    cfg = model_config(name)
    assert cfg.vocab_size is None
    if name == "k3_small":  # building 200M parameters is slow here; the config alone is validated
        fields = OmegaConf.to_container(cfg)
        fields.pop("_target_")
        config = KimiK3Config(**fields)
        assert config.layer_pattern.count("mla") > 0
        return
    cfg.vocab_size = 257
    model = instantiate(cfg)
    assert isinstance(model, KimiK3) and model.config.vocab_size == 257
    # the config round-trips through a plain dict (run.json / checkpoint metadata -> a rebuilt model)
    assert KimiK3.from_fields(**asdict(model.config)).config == model.config
    kinds = [layer.mixer_type for layer in model.layers]
    assert kinds == (["kda", "kda", "kda", "mla"] if name == "k3_tiny" else ["mla"] * 4)
    assert [isinstance(layer.ffn, MoE) for layer in model.layers] == [False, True, True, True]


# --- attention residuals (tests/test_attn_res.py checks the mix and the block structure numerically) ----------------

MIX_NAMES = ("self_attention_res_norm", "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj")


def test_without_attn_res_the_forward_is_exactly_x_plus_f_x():
    model = tiny_model().eval()
    assert model.config.attn_res_block_size is None
    assert not [n for n, _ in model.named_parameters() if "_res_" in n]
    x, _ = batch()
    with torch.no_grad():
        h = model.embed_tokens(x)
        for layer in model.layers:
            h = h + layer.mixer(layer.mixer_norm(h))
            h = h + layer.ffn(layer.ffn_norm(h))
        assert torch.equal(model(x)[0], model.lm_head(model.norm(h)))


def test_attn_res_parameters_have_the_released_names_shapes_and_init():
    """Per layer <point>_res_norm [d] (ones) and <point>_res_proj [1, d] (Normal(init_std), as the reference
    initialises them), plus output_attn_res_{norm,proj}: the names the released checkpoint uses, so an import maps
    them 1:1 (model.layers.{i}.X -> layers.{i}.X, model.output_attn_res_X -> output_attn_res_X)."""
    plain, model = tiny_model(), tiny_model(attn_res_block_size=2)
    new = set(model.state_dict()) - set(plain.state_dict())
    assert set(plain.state_dict()) <= set(model.state_dict())
    assert new == {f"layers.{i}.{m}.weight" for i in range(4) for m in MIX_NAMES} | {
        "output_attn_res_norm.weight",
        "output_attn_res_proj.weight",
    }
    params = dict(model.named_parameters())
    projs = torch.cat([params[n] for n in sorted(new) if "_res_proj" in n])
    norms = [params[n] for n in new if "_res_norm" in n]
    assert projs.shape == (9, 32) and all(params[n].shape == (1, 32) for n in new if "_res_proj" in n)
    assert all(n.shape == (32,) and torch.equal(n, torch.ones(32)) for n in norms)
    assert 0.015 < projs.std().item() < 0.025 and abs(projs.mean().item()) < 0.005  # 288 draws of N(0, 0.02)


def test_attn_res_trains_every_parameter_but_layer_0s_unused_attention_mix():
    """Layer 0 has no finished block to mix with: its attention mix is kept for the checkpoint layout but unused."""
    model = tiny_model(attn_res_block_size=2)
    x, y = batch()
    _, loss = model(x, y)
    loss.backward()
    unused = {f"layers.0.{m}.weight" for m in MIX_NAMES[:2]}
    no_grad = {n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0}
    assert no_grad == unused
    # frozen, so optimizers leave them out and DDP does not wait for their gradients; still in the state_dict
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == unused
    assert unused <= set(model.state_dict())
    assert abs(loss.item() - torch.log(torch.tensor(float(V))).item()) < 0.5  # near-uniform at init
