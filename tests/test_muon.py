"""MuonAdamW against torch's own Muon and AdamW, per-head and per-expert views, exact resume, diagnostics."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from k3train.optim import muon as muon_module
from k3train.optim.muon import MuonAdamW, zeropower_via_newtonschulz5

LR, WD = 0.02, 0.1


def _grads(shape: tuple[int, ...], steps: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(steps)]


def _run(opt: torch.optim.Optimizer, params: list[nn.Parameter], grads: list[list[torch.Tensor]]) -> None:
    """One opt.step() per entry of grads; grads[t][i] is param i's gradient at step t (None: no gradient)."""
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else g.clone()
        opt.step()


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (48, 48), (3, 16, 40), (2, 3, 40, 16)])
def test_newton_schulz_singular_values_in_band(shape: tuple[int, ...]) -> None:
    G = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    O = zeropower_via_newtonschulz5(G)
    assert O.shape == G.shape and O.dtype == torch.bfloat16
    s = torch.linalg.svdvals(O.float())
    # 5 quintic steps land singular values roughly in U(0.5, 1.5) (KellerJordan/Muon), not at 1.
    assert s.min() > 0.5 and s.max() < 1.5, (s.min(), s.max())


def test_newton_schulz_batch_equals_each_matrix() -> None:
    G = torch.randn(5, 24, 40, generator=torch.Generator().manual_seed(2))
    batched = zeropower_via_newtonschulz5(G)
    for i in range(5):
        assert torch.equal(batched[i], zeropower_via_newtonschulz5(G[i]))


def _muon_group(params: list[nn.Parameter], head_splits=None, **kw) -> dict:
    group = dict(name="m", kind="muon", params=params, **kw)
    if head_splits is not None:
        group["head_splits"] = head_splits
    return group


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_torch_muon(shape: tuple[int, int], nesterov: bool) -> None:
    init = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    ours, ref = nn.Parameter(init.clone()), nn.Parameter(init.clone())
    grads = [[g] for g in _grads(shape, 6)]
    _run(MuonAdamW([_muon_group([ours])], lr=LR, weight_decay=WD, momentum=0.95, nesterov=nesterov), [ours], grads)
    _run(
        torch.optim.Muon(
            [ref], lr=LR, weight_decay=WD, momentum=0.95, nesterov=nesterov, adjust_lr_fn="match_rms_adamw"
        ),
        [ref],
        grads,
    )
    assert not torch.equal(ours, init)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


def _per_slice_reference(init: torch.Tensor, grads: list[torch.Tensor], slices: list[tuple]) -> torch.Tensor:
    """Run an independent torch.optim.Muon on each slice of the weight; reassemble the weight."""
    out = init.clone()
    for index in slices:
        p = nn.Parameter(init[index].clone())
        _run(
            torch.optim.Muon([p], lr=LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw"),
            [p],
            [[g[index]] for g in grads],
        )
        out[index] = p.detach()
    return out


@pytest.mark.parametrize("dim", [0, 1])
def test_head_wise_view_equals_muon_per_head(dim: int) -> None:
    H, dh, d = 4, 8, 20
    shape = (H * dh, d) if dim == 0 else (d, H * dh)
    init = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    grads = _grads(shape, 4, seed=5)
    p = nn.Parameter(init.clone())
    _run(MuonAdamW([_muon_group([p], head_splits=[(H, dim)])], lr=LR, weight_decay=WD), [p], [[g] for g in grads])
    heads = [slice(h * dh, (h + 1) * dh) for h in range(H)]
    slices = [(h, slice(None)) if dim == 0 else (slice(None), h) for h in heads]
    torch.testing.assert_close(p.detach(), _per_slice_reference(init, grads, slices), atol=1e-6, rtol=0)
    # and it is not the same as treating the weight as one matrix
    whole = nn.Parameter(init.clone())
    _run(MuonAdamW([_muon_group([whole])], lr=LR, weight_decay=WD), [whole], [[g] for g in grads])
    assert (whole - p).abs().max() > 1e-3


def test_expert_stack_equals_muon_per_expert() -> None:
    shape = (3, 16, 24)
    init = torch.randn(shape, generator=torch.Generator().manual_seed(6))
    grads = _grads(shape, 4, seed=7)
    p = nn.Parameter(init.clone())
    _run(MuonAdamW([_muon_group([p])], lr=LR, weight_decay=WD), [p], [[g] for g in grads])
    torch.testing.assert_close(
        p.detach(), _per_slice_reference(init, grads, [(e,) for e in range(3)]), atol=1e-6, rtol=0
    )


def test_adamw_group_matches_torch_adamw() -> None:
    shapes = [(10, 6), (6,), (4, 1, 3)]
    inits = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    grads = [[g[t] for g in [_grads(s, 5, seed=10 + i) for i, s in enumerate(shapes)]] for t in range(5)]
    grads[2][1] = None  # a step without gradient for one param: skipped by both
    ours = [nn.Parameter(x.clone()) for x in inits]
    ref = [nn.Parameter(x.clone()) for x in inits]
    _run(
        MuonAdamW([dict(name="a", kind="adamw", params=ours)], lr=1e-2, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8),
        ours,
        grads,
    )
    _run(torch.optim.AdamW(ref, lr=1e-2, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8, foreach=False), ref, grads)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, atol=1e-7, rtol=1e-6)


def _mixed_params() -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(8)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in [(16, 12), (12, 16), (2, 8, 12), (12,), (30, 12)]]


def _mixed_optimizer(params: list[nn.Parameter], **kw) -> MuonAdamW:
    return MuonAdamW(
        [_muon_group(params[:3], head_splits=[(4, 0), (4, 1), None]), dict(name="a", kind="adamw", params=params[3:])],
        lr=LR,
        weight_decay=WD,
        **kw,
    )


def test_state_dict_round_trip_continues_bitwise() -> None:
    params = _mixed_params()
    grads = [
        [torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * t + i)) for i, p in enumerate(params)]
        for t in range(6)
    ]
    opt = _mixed_optimizer(params)
    _run(opt, params, grads[:3])
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # as the Trainer's checkpoint loads it
    resumed = [nn.Parameter(x.clone()) for x in saved["params"]]
    resumed_opt = _mixed_optimizer(resumed)
    resumed_opt.load_state_dict(saved["optim"])
    _run(opt, params, grads[3:])
    _run(resumed_opt, resumed, grads[3:])
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)
    for a, b in zip(params, resumed):
        sa, sb = opt.state[a], resumed_opt.state[b]
        assert sa.keys() == sb.keys() and all(
            torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k] for k in sa
        )


def test_params_without_grad_are_skipped() -> None:
    params = _mixed_params()
    before = [p.detach().clone() for p in params]
    opt = _mixed_optimizer(params)
    _run(opt, params, [[torch.ones(p.shape) if i in (0, 3) else None for i, p in enumerate(params)]])
    changed = [not torch.equal(p, b) for p, b in zip(params, before)]
    assert changed == [True, False, False, True, False]
    assert set(map(id, opt.state)) == {id(params[0]), id(params[3])}


def test_diagnostics_and_orthogonality_check_only_when_due(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = muon_module.orthogonality_error
    monkeypatch.setattr(muon_module, "orthogonality_error", lambda O: calls.append(O.shape) or real(O))
    params = _mixed_params()
    opt = _mixed_optimizer(params, orthogonality_check_interval=2)
    assert set(opt.diagnostics()) == {f"{g}/{k}" for g in ("m", "a") for k in ("lr", "weight_norm")}
    for _ in range(5):
        _run(opt, params, [[torch.randn(p.shape) for p in params]])
    # due at steps 1, 3, 5, one matrix each time, round-robin over the group's 3 params: a head of (4, dim=0),
    # a head of (4, dim=1), an expert
    assert calls == [torch.Size([4, 12]), torch.Size([12, 4]), torch.Size([8, 12])]
    diag = opt.diagnostics()
    expected = {f"{g}/{k}" for g in ("m", "a") for k in ("lr", "weight_norm", "update_rms")}
    assert set(diag) == expected | {"m/ns_orthogonality_error"}
    assert all(math.isfinite(v) for v in diag.values())
    assert diag["m/lr"] == LR and 0 < diag["m/ns_orthogonality_error"] < 0.6
    # weight norm is that of the current weights; the RMS-matched Muon update is ~rms_match * lr * (0.7..1.1)
    assert diag["a/weight_norm"] == pytest.approx(torch.cat([p.flatten() for p in params[3:]]).norm().item())
    assert 0.1 * LR < diag["m/update_rms"] < 0.3 * LR


def test_bad_groups_are_rejected() -> None:
    p2, p1 = nn.Parameter(torch.zeros(8, 4)), nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match="'kind'"):
        MuonAdamW([dict(name="x", params=[p2])])
    with pytest.raises(ValueError, match="send it to an AdamW group"):
        MuonAdamW([_muon_group([p1])])
    with pytest.raises(ValueError, match="does not fit shape"):
        MuonAdamW([_muon_group([p2], head_splits=[(3, 0)])])
    with pytest.raises(ValueError, match="duplicate param group name"):
        MuonAdamW([_muon_group([p2]), dict(name="m", kind="adamw", params=[p1])])


def test_deterministic_on_cpu() -> None:
    results = []
    for _ in range(2):
        params = _mixed_params()
        _run(_mixed_optimizer(params), params, [[torch.ones(p.shape) * (t + 1) for p in params] for t in range(3)])
        results.append(copy.deepcopy([p.detach() for p in params]))
    assert all(torch.equal(a, b) for a, b in zip(*results))


# ---- Newton-Schulz dtype (issue 9): bf16 where the hardware has it, fp32 elsewhere ----------------------------
def _newton_schulz_float64(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic of KellerJordan/Muon written out in float64, one matrix at a time: the reference."""
    a, b, c = muon_module.NS_COEFFICIENTS
    X = G.double()
    tall = X.size(0) > X.size(1)
    X = X.T if tall else X
    X = X / X.norm().clamp(min=1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
def test_newton_schulz_fp32_matches_float64_reference(shape: tuple[int, int]) -> None:
    G = torch.randn(shape, generator=torch.Generator().manual_seed(11))
    O = zeropower_via_newtonschulz5(G, dtype=torch.float32)
    assert O.dtype == torch.float32
    ref = _newton_schulz_float64(G)
    torch.testing.assert_close(O.double(), ref, atol=2e-5, rtol=0)
    # bf16 is much further off (8 mantissa bits): the fp32 path is a different computation, not a relabelling
    assert (zeropower_via_newtonschulz5(G).double() - ref).abs().max() > 1e-3


def test_muon_fp32_step_matches_float64_reference() -> None:
    shape, mu, steps = (16, 40), 0.95, 4
    init = torch.randn(shape, generator=torch.Generator().manual_seed(12))
    grads = _grads(shape, steps, seed=13)
    p = nn.Parameter(init.clone())
    _run(MuonAdamW([_muon_group([p])], lr=LR, weight_decay=WD, momentum=mu, ns_dtype="fp32"), [p], [[g] for g in grads])
    ref, buf = init.double(), torch.zeros(shape, dtype=torch.float64)
    for g in grads:  # torch.optim.Muon's update (EMA Nesterov momentum, match_rms_adamw scale), in float64
        buf = buf + (1 - mu) * (g.double() - buf)
        nesterov = g.double() + mu * (buf - g.double())
        ref = ref * (1 - LR * WD) - LR * 0.2 * math.sqrt(max(shape)) * _newton_schulz_float64(nesterov)
    torch.testing.assert_close(p.detach().double(), ref, atol=1e-5, rtol=0)


def test_ns_dtype_auto_follows_the_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    from k3train.optim import build

    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    settings = dict(
        lr=LR,
        weight_decay=WD,
        betas=[0.9, 0.95],
        eps=1e-8,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        rms_match=0.2,
        head_wise=True,
        orthogonality_check_interval=50,
    )

    def ns_dtypes(opt: MuonAdamW) -> set[str]:
        return {g["ns_dtype"] for g in opt.param_groups if g["kind"] == "muon"}

    # A CPU without native bf16 (AVX2 only: bf16 matmuls 10-200x slower than fp32) gets fp32 ...
    monkeypatch.setattr(build, "native_bf16", lambda device: False)
    assert ns_dtypes(build.muon_adamw(model, **settings, ns_dtype="auto")) == {"fp32"}
    # ... one with it (and a GPU with bf16) gets bf16, torch.optim.Muon's dtype
    monkeypatch.setattr(build, "native_bf16", lambda device: True)
    assert ns_dtypes(build.muon_adamw(model, **settings, ns_dtype="auto")) == {"bf16"}
    # the override wins over the hardware either way
    assert ns_dtypes(build.muon_adamw(model, **settings, ns_dtype="fp32")) == {"fp32"}
    with pytest.raises(ValueError, match=r"^optim.ns_dtype=fp16 must be auto, bf16 or fp32"):
        build.muon_adamw(model, **settings, ns_dtype="fp16")


def test_native_bf16_detection_without_bf16_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    from k3train.runtime import cpu

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"avx", "avx2", "fma"})  # an AVX2-only EPYC
    assert not cpu.native_bf16("cpu")
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert cpu.native_bf16("cpu")


# ---- settings name the bad key (issue 8, defect 2) ---------------------------------------------------------------
_ADAMW = dict(lr=LR, weight_decay=WD, betas=[0.9, 0.95], eps=1e-8)
_MUON = dict(momentum=0.95, nesterov=True, ns_steps=5, rms_match=0.2, head_wise=True, orthogonality_check_interval=50)


@pytest.mark.parametrize("factory", ["adamw", "muon_adamw"])
@pytest.mark.parametrize(
    "key, value, rule",
    [
        ("lr", float("nan"), "a finite number >= 0"),
        ("lr", float("inf"), "a finite number >= 0"),
        ("lr", -1e-3, "a finite number >= 0"),
        ("weight_decay", float("nan"), "a finite number >= 0"),
        ("eps", 0.0, "a finite number > 0"),
        ("betas", [0.9, float("nan")], "betas[1]=nan must be"),
        ("betas", [1.0, 0.95], "betas[0]=1.0 must be a finite number >= 0 and < 1"),
    ],
)
def test_bad_settings_name_the_key(factory: str, key: str, value, rule: str) -> None:
    from k3train.optim import build

    kwargs = {**_ADAMW, **(_MUON if factory == "muon_adamw" else {}), key: value}
    with pytest.raises(ValueError) as info:
        getattr(build, factory)(nn.Linear(4, 4), **kwargs)
    message = str(info.value)
    assert message.startswith(f"optim.{key}") and rule in message, message


@pytest.mark.parametrize(
    "key, value",
    [
        ("momentum", 1.0),
        ("momentum", float("nan")),
        ("ns_steps", 0),
        ("rms_match", float("nan")),
        ("rms_match", 0.0),
        ("orthogonality_check_interval", 0),
    ],
)
def test_bad_muon_settings_name_the_key(key: str, value) -> None:
    from k3train.optim import build

    with pytest.raises(ValueError, match=rf"^optim\.{key}={value} must be"):
        build.muon_adamw(nn.Linear(4, 4), **{**_ADAMW, **_MUON, key: value})
    with pytest.raises(ValueError, match=rf"^{key}={value} must be"):  # constructing the optimizer directly
        MuonAdamW([_muon_group([nn.Parameter(torch.zeros(4, 4))])], **{key: value})


@pytest.mark.slow
@pytest.mark.parametrize(
    "optim, value",
    [("adamw", "nan"), ("muon_adamw", "nan"), ("adamw", "inf"), ("muon_adamw", "inf"), ("muon_adamw", "-0.1")],
)
def test_cli_refuses_a_bad_lr_naming_it(run_cli, tmp_path, optim: str, value: str) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        "model=smoke_test_lm", f"optim={optim}", f"optim.lr={value}", "train.max_steps=1", f"hydra.run.dir={run_dir}"
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"optim.lr={float(value)} must be a finite number >= 0" in lines[0], proc.stderr
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "last.pt").exists()


# ---- diagnostics survive a resume (issue 8, defect 10) -----------------------------------------------------------
def test_orthogonality_error_survives_state_dict_round_trip() -> None:
    params = _mixed_params()
    opt = _mixed_optimizer(params, orthogonality_check_interval=4)
    _run(opt, params, [[torch.randn(p.shape) for p in params] for _ in range(2)])  # measured at step 1 only
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed = _mixed_optimizer([nn.Parameter(p.detach().clone()) for p in params], orthogonality_check_interval=4)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    grads = [[torch.randn(p.shape) for p in params]]
    _run(opt, params, grads)
    _run(resumed, list(resumed.param_groups[0]["params"]) + list(resumed.param_groups[1]["params"]), grads)
    assert opt.diagnostics() == resumed.diagnostics()
    assert "m/ns_orthogonality_error" in resumed.diagnostics()


@pytest.mark.slow
def test_resumed_run_logs_the_same_optimizer_diagnostics(run_cli, tmp_path) -> None:
    from k3train.observe.metrics import read_metrics

    shape = [
        "model=k3_tiny",
        "model.d_model=32",
        "model.n_layers=2",
        "model.expert_ffn_dim=16",
        "model.dense_ffn_dim=32",
        "model.kda_chunk_size=16",
        "train.batch_size=2",
        "train.seq_len=32",
        "train.log_interval=1",
        "train.eval_interval=0",
        "train.eval_batches=1",
        "train.progress=lines",
        "train.max_steps=6",
        "optim.orthogonality_check_interval=4",
    ]

    def diagnostics(run_dir) -> dict[int, list[str]]:  # the last train event of each step (a resume may repeat)
        train = {
            e["step"]: sorted(e["optimizer"]) for e in read_metrics(run_dir / "metrics.jsonl") if e["event"] == "train"
        }
        return train

    whole, sliced = tmp_path / "whole", tmp_path / "sliced"
    assert run_cli(*shape, f"hydra.run.dir={whole}").returncode == 0
    for _ in range(2):
        proc = run_cli(*shape, f"hydra.run.dir={sliced}", "resume=auto", "train.stop_after=3")
        assert proc.returncode == 0, proc.stderr
    expected = diagnostics(whole)
    assert list(expected) == [1, 2, 3, 4, 5, 6]
    assert all(any(k.endswith("/ns_orthogonality_error") for k in keys) for keys in expected.values())
    assert diagnostics(sliced) == expected


def test_adamw_baseline_takes_torchs_fused_kernel_and_matches_the_reference() -> None:
    """optim=adamw runs torch's fused AdamW on plain CPU parameters (its default there is a per-op loop, ~5x slower
    on k3_small) and must update exactly as the reference AdamW does, weight decay groups included."""
    from k3train.optim import build

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    reference = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt = build.adamw(model, lr=1e-2, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8)
    assert opt.defaults["fused"] is True
    index = {id(p): i for i, p in enumerate(model.parameters())}
    ref_groups = [
        dict(params=[reference[index[id(p)]] for p in g["params"]], weight_decay=g["weight_decay"])
        for g in opt.param_groups
    ]
    ref_opt = torch.optim.AdamW(ref_groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for t in range(5):
        grads = [
            torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * t + i))
            for i, p in enumerate(model.parameters())
        ]
        for p, r, g in zip(model.parameters(), reference, grads):
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert {g["weight_decay"] for g in opt.param_groups} == {0.0, 0.1}
    for p, r in zip(model.parameters(), reference):
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-6, rtol=1e-6)
