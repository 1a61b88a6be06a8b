"""conf/: composition and override semantics, and every option of every group and every experiment built the way
the runner builds it, at a tiny size (no training run). Options are found in conf/, so a new YAML file is tested
without editing this file."""

import functools
import math
from importlib.resources import files

import pytest
import torch
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

from k3train.config import ProfileConfig, TrainConfig, check_known_keys
from k3train.train.precision import Precision

from helpers.config import MODEL_BASES, built_run, composed

GROUPS = ("model", "optim", "schedule", "precision", "data")
NAMED_GROUPS = ("callbacks", "logger")  # groups whose options list any number of named `_target_` nodes


def options(group: str) -> list[str]:
    return sorted(p.name[:-5] for p in (files("k3train.conf") / group).iterdir() if p.name.endswith(".yaml"))


@functools.cache
def default_option(group: str) -> str:
    return composed(return_hydra_config=True).hydra.runtime.choices[group]


def with_option(group: str, option: str):
    """The default config with `group=option`. The default option composes to the default config, so that one is
    not composed again (composing takes ~0.1 s)."""
    return composed() if option == default_option(group) else composed(f"{group}={option}")


def test_every_group_and_the_experiments_have_options():
    for group in (*GROUPS, *NAMED_GROUPS, "parallel", "experiment"):
        assert options(group), group


def test_defaults_compose_to_a_typed_train_config():
    cfg = composed()
    check_known_keys(cfg)  # the defaults add no unknown key
    train = OmegaConf.to_object(cfg.train)
    assert isinstance(train, TrainConfig)
    assert train.batch_size == cfg.train.batch_size and train.device == "auto"
    for group in GROUPS:
        assert "_target_" in cfg[group], group


def test_explicit_false_and_zero_beat_true_and_nonzero_defaults():
    """The seeds' merge rule: an explicitly given false/0 is an override, not 'unset'."""
    base = composed("train.deterministic=true", "train.grad_clip=1.0")
    assert base.train.deterministic is True and base.train.grad_clip == 1.0
    cfg = composed("train.deterministic=false", "train.grad_clip=0", "train.eval_interval=0")
    assert cfg.train.deterministic is False and cfg.train.grad_clip == 0 and cfg.train.eval_interval == 0
    assert OmegaConf.to_object(cfg.train).clip_norm is None  # 0 disables clipping


def test_misspelt_key_fails_naming_it():
    with pytest.raises(ConfigCompositionException) as err:
        composed("train.batch_szie=4")
    assert "batch_szie" in str(err.value)


@pytest.mark.parametrize(
    "override,key,hint",
    [
        ("+train.max_stpes=5", "train.max_stpes", "train.max_steps"),  # the form Hydra's own error hint suggests
        ("++train.max_stpes=5", "train.max_stpes", "train.max_steps"),
        ("+profile.activ=2", "profile.activ", "profile.active"),
        ("+resum=auto", "resum", "resume"),
    ],
)
def test_a_key_added_with_plus_is_refused_naming_it(override, key, hint):
    cfg = composed(override)  # Hydra lets it into the structured config...
    with pytest.raises(ValueError) as err:
        check_known_keys(cfg)  # ...the runner does not
    assert str(err.value).startswith(f"unknown key {key} (did you mean {hint}?)")


def test_an_unknown_key_in_a_config_file_is_refused_naming_it(tmp_path):
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "typo.yaml").write_text("# @package _global_\ntrain:\n  max_stpes: 5\n")
    with pytest.raises(ConfigCompositionException) as err:
        composed(f"hydra.searchpath=[file://{tmp_path}]", "+extra=typo")  # what --config-dir does
    assert "max_stpes" in str(err.value.__cause__ or err.value)


def test_wrong_type_fails_naming_the_key():
    with pytest.raises(ConfigCompositionException) as err:
        composed("train.batch_size=abc")
    assert "batch_size" in str(err.value.__cause__ or err.value)


def test_cross_field_checks_run_when_the_typed_config_is_built():
    cfg = composed("train.batch_size=0")
    with pytest.raises(ValueError, match="train.batch_size must be >= 1"):
        OmegaConf.to_object(cfg.train)


def test_unknown_group_option_lists_the_choices():
    with pytest.raises(ConfigCompositionException) as err:
        composed("optim=sgd")
    assert "adamw" in str(err.value)


# Every option is built as the runner builds it (k3train/run/runner.py), shrunk to widths that run in milliseconds:
# the shrink applies to the keys a model config has, so a new model YAML needs no entry here.
TINY_MODEL = {
    "d_model": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "kda_head_dim": 8,
    "kda_chunk_size": 16,
    "n_routed_experts": 8,
    "experts_per_token": 2,
    "expert_ffn_dim": 16,
    "dense_ffn_dim": 32,
    "n_layers": 4,
    "mla_n_heads": 4,
    "kda_n_heads": 4,
}
# Shrunk only where the config sets them: null keeps the component off.
TINY_WHEN_SET = {"q_lora_rank": 16, "expert_latent_dim": 16, "attn_res_block_size": 2}
V, B, T = 97, 2, 16


def tiny_model(cfg):
    for key, value in TINY_MODEL.items():
        if key in cfg.model:
            cfg.model[key] = value
    for key, value in TINY_WHEN_SET.items():
        if cfg.model.get(key) is not None:
            cfg.model[key] = value
    torch.manual_seed(0)
    return instantiate(cfg.model, vocab_size=V)  # the vocabulary comes from the data, as in the runner


def tokens():
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    return x, x.roll(-1, dims=1)


@pytest.mark.parametrize("option", [o for o in options("model") if o not in MODEL_BASES])
def test_every_model_builds_and_starts_near_a_uniform_guess(option):
    model = tiny_model(with_option("model", option))
    model.check_data(V, T)
    x, y = tokens()
    loss = model(x, y)[1]
    assert model(x)[0].shape == (B, T, V) and loss.dtype == torch.float32  # logits: from a call without targets
    assert abs(loss.item() - math.log(V)) < 0.5, loss.item()  # small initial weights: near-uniform predictions
    counts = model.param_counts()
    assert 0 < counts["embedding"] < counts["active"] <= counts["total"] == sum(p.numel() for p in model.parameters())


def test_k3_tiny_small_and_k3_are_k3_base_and_their_sizes():
    """Kimi K3's form lives in k3_base alone: each size sets exactly the fields the base leaves ??? and nothing
    else, so a component cannot differ between sizes by accident; the base itself is no model."""
    import yaml

    base = OmegaConf.load(files("k3train.conf") / "model" / "k3_base.yaml")
    sizes = {key for key in base if OmegaConf.is_missing(base, key)}
    assert {"d_model", "n_layers", "n_routed_experts"} <= sizes
    for option in ("k3_tiny", "k3_small", "k3"):
        own = yaml.safe_load((files("k3train.conf") / "model" / f"{option}.yaml").read_text())
        assert own.pop("defaults") == ["k3_base", "_self_"], option
        assert set(own) == sizes, (option, set(own) ^ sizes)
        model = with_option("model", option).model
        assert not any(OmegaConf.is_missing(model, key) for key in model), option
        assert all(model[key] == base[key] for key in base if key not in sizes), option
    with pytest.raises(MissingMandatoryValue):
        OmegaConf.to_container(with_option("model", "k3_base").model, throw_on_missing=True)


def test_k3_mla_only_is_k3_tiny_with_mla_in_every_layer():
    tiny = OmegaConf.to_container(with_option("model", "k3_tiny").model)
    mla_only = OmegaConf.to_container(with_option("model", "k3_mla_only").model)
    assert mla_only.keys() == tiny.keys()
    assert {key for key in tiny if tiny[key] != mla_only[key]} == {"kda_mla_ratio"}


@pytest.mark.parametrize("option", options("optim"))
def test_every_optimizer_groups_every_parameter_and_takes_a_step(option):
    cfg = with_option("optim", option)
    model = tiny_model(cfg)
    optimizer = instantiate(cfg.optim)(model)
    grouped = [p for g in optimizer.param_groups for p in g["params"]]
    trainable = [p for p in model.parameters() if p.requires_grad]  # k3_tiny's layer-0 attention mix is frozen
    assert len(grouped) == len({id(p) for p in grouped}) == len(trainable)
    for group in optimizer.param_groups:  # what the schedule and the run summary read (docs/contracts.md)
        assert group["name"] and group["kind"] in ("muon", "adamw") and group["initial_lr"] == cfg.optim.lr
    before = [p.detach().clone() for p in grouped]
    model(*tokens())[1].backward()
    optimizer.step()
    for old, p in zip(before, grouped):
        assert p.grad is None or not torch.equal(old, p)  # every parameter that got a gradient moved


@pytest.mark.parametrize("option", options("schedule"))
def test_every_schedule_reaches_the_peak_lr_and_stays_within_it(option):
    cfg = with_option("schedule", option)
    schedule = instantiate(cfg.schedule)(total_steps=cfg.train.max_steps)  # as the Trainer completes it
    factors = [schedule.factor(step) for step in range(cfg.train.max_steps)]
    assert all(0 < f <= 1 for f in factors) and max(factors) == 1.0


@pytest.mark.parametrize("option", options("precision"))
def test_every_precision_autocasts_and_takes_a_scaled_update(option):
    cfg = with_option("precision", option)
    precision, cpu = instantiate(cfg.precision), torch.device("cpu")
    model = tiny_model(cfg).to(precision.param_dtype)  # as build_parts places it: fp64 weights under precision=fp64
    assert isinstance(precision, Precision)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = precision.make_scaler(cpu)
    assert scaler.is_enabled() == (precision.dtype == "fp16")
    x, y = tokens()
    with precision.autocast(cpu), torch.no_grad():  # logits come from a call without targets
        assert model.eval()(x)[0].dtype == precision.torch_dtype
    model.train()
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(8):  # fp16's first loss scales overflow: those updates are skipped and the scale halves
        with precision.autocast(cpu):
            _, loss = model(x, y)
        assert loss.dtype == precision.param_dtype and torch.isfinite(loss)  # fp32, or fp64 for fp64
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if any(not torch.equal(old, p) for old, p in zip(before, model.parameters())):
            break
    else:
        pytest.fail(f"precision={option}: 8 updates were all skipped")


@pytest.mark.parametrize("option", options("data"))
def test_every_data_option_loads_next_token_batches(option, k3_cache, tiny_data_dir):
    cfg = with_option("data", option)
    if OmegaConf.is_missing(cfg.data, "path"):
        cfg.data.path = str(tiny_data_dir)  # what the user gives: data.path=DIR
    if "cache_dir" in cfg.data:
        cfg.data.cache_dir = str(k3_cache)  # the test session's cache, not ~/.cache
    data = instantiate(cfg.data)
    for loader in data.loaders(B, T):  # tiny_data_dir's val split holds 73 tokens
        x, y, _ = loader.next_batch()
        assert x.shape == y.shape == (B, T) and torch.equal(x[:, 1:], y[:, :-1])
        assert 0 <= x.min() and x.max() < data.vocab_size


def sweep_jobs(cfg) -> list[list[str]]:
    """The overrides of each job a multirun launches from cfg's hydra.sweeper.params, as Hydra's basic sweeper
    expands them ([[]]: one job, the config itself)."""
    params = cfg.hydra.sweeper.get("params") or {}
    overrides = OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in params.items()])
    return BasicSweeper.split_arguments(overrides, max_batch_size=None)[0]


def without_hydra(cfg):
    return OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])


def planned_updates(train: TrainConfig):
    """The Trainer's plan from the recipe's limits (None: until the data runs out, which needs the data)."""
    tokens_per_update = train.batch_size * train.seq_len * train.gradient_accumulation_steps
    limits = [train.max_steps, train.max_tokens and math.ceil(train.max_tokens / tokens_per_update)]
    return min((n for n in limits if n), default=None)


@pytest.mark.parametrize("name", options("experiment"))
def test_every_experiment_and_each_job_of_its_sweep_builds(name):
    """What `python -m k3train experiment=NAME` runs (each job, for a sweep) passes the runner's checks and builds
    every part but the data: a recipe can only leave data.path to the user."""
    experiment = composed(f"experiment={name}", return_hydra_config=True)
    for job in sweep_jobs(experiment):
        cfg = composed(f"experiment={name}", *job) if job else experiment
        check_known_keys(cfg)
        train = OmegaConf.to_object(cfg.train)  # the cross-field checks
        assert isinstance(OmegaConf.to_object(cfg.profile), ProfileConfig)
        assert OmegaConf.missing_keys(without_hydra(cfg)) <= {"data.path"}  # hydra's own ??? are filled at run time
        model = tiny_model(cfg)
        model.check_data(V, train.seq_len)  # the recipe's seq_len fits the model's max_seq_len
        instantiate(cfg.optim)(model)
        planned = planned_updates(train)
        schedule = instantiate(cfg.schedule)(total_steps=planned or 1)
        assert planned is None or schedule.warmup_steps < planned  # else the lr never reaches its peak
        assert isinstance(instantiate(cfg.precision), Precision)


def test_the_muon_vs_adamw_sweep_runs_both_optimizers_at_each_lr():
    """benchmarks/sweep_muon_vs_adamw.py's table: each optimizer at each lr of the grid, once (the test above
    composes and builds each of these jobs)."""
    experiment = composed("experiment=muon_vs_adamw", return_hydra_config=True)
    assert experiment.hydra.mode == RunMode.MULTIRUN  # a sweep even without -m
    jobs = sorted((job[0], float(job[1].split("=")[1])) for job in sweep_jobs(experiment))
    assert jobs == [(f"optim={optim}", lr) for optim in ("adamw", "muon_adamw") for lr in (1e-3, 3e-3, 1e-2)]


def test_the_quickstart_experiment_is_the_default_run():
    quickstart = without_hydra(composed("experiment=quickstart", return_hydra_config=True))
    default = without_hydra(composed(return_hydra_config=True))
    assert OmegaConf.to_container(quickstart) == OmegaConf.to_container(default)


@pytest.mark.parametrize("option", options("parallel"))
def test_every_parallel_option_leaves_one_process_as_it_is(option):
    """In one process (no process group) a strategy runs the model itself: the single-process path is unchanged."""
    from k3train.runtime.parallel_dims import ParallelDims

    strategy, dims = instantiate(with_option("parallel", option).parallel), ParallelDims()
    model = torch.nn.Linear(2, 2)
    assert strategy.shard(model, torch.device("cpu"), dims) is model
    assert strategy.wrap(model, torch.device("cpu"), dims) is model
    with strategy.no_sync(model):
        pass
    assert dims.describe() == "one process"


@pytest.mark.parametrize("group,option", [(g, o) for g in NAMED_GROUPS for o in options(g) if o != "none"])
def test_every_callbacks_and_logger_option_builds_what_the_runner_checks(group, option, tmp_path):
    from k3train.observe.metrics import MetricsSink
    from k3train.runtime.parallel_dims import ParallelDims
    from k3train.train.callbacks import Callback

    kind, kwargs = (Callback, {}) if group == "callbacks" else (MetricsSink, {"run_dir": str(tmp_path)})
    nodes = with_option(group, option)[group]
    assert len(nodes) >= 1, f"{group}={option} lists nothing to build"  # `none` is the one that may: below
    for name, node in nodes.items():
        part = instantiate(node, **kwargs)
        assert isinstance(part, kind), f"{group}.{name}"
        if group == "callbacks":
            part.setup(tiny_model(with_option("model", "k3_tiny")), None, ParallelDims())  # one process
            assert part.describe()
    assert list(tmp_path.iterdir()) == []  # nothing is written before the first event


def test_callbacks_none_builds_no_callback_and_the_run_still_builds_and_steps(monkeypatch, tmp_path, tiny_data_dir):
    from k3train.train.callbacks import QKClip

    cfg, parts = built_run(monkeypatch, tmp_path / "none", tiny_data_dir, "callbacks=none")
    assert OmegaConf.to_container(cfg.callbacks) == {}  # the option lists no callback...
    trainer = parts["trainer"]
    # ...and the runner builds none of the config's, not the default QK-Clip (cpu_threads is the runtime's own:
    # build_parts adds it to CPU runs with auto threads, whatever `callbacks` says)
    assert set(trainer.callbacks) <= {"cpu_threads"}
    trainer.train_step()  # an update runs without any callback
    assert trainer.state.step == 1
    assert not (tmp_path / "none").exists()  # building writes nothing
    # The default builds QK-Clip through the same path: `none` is an empty group, not a group the builder skips.
    _, parts = built_run(monkeypatch, tmp_path / "default", tiny_data_dir, "callbacks=default")
    callbacks = parts["trainer"].callbacks
    assert set(callbacks) - {"cpu_threads"} == {"qk_clip"} and isinstance(callbacks["qk_clip"], QKClip)


def test_logger_none_builds_no_sink_beside_metrics_jsonl_and_the_run_still_builds(monkeypatch, tmp_path, tiny_data_dir):
    from k3train.observe.metrics import JsonlSink
    from k3train.observe.sinks import TensorBoardSink

    cfg, parts = built_run(monkeypatch, tmp_path / "none", tiny_data_dir, "logger=none")
    assert OmegaConf.to_container(cfg.logger) == {}  # the option lists no sink...
    sinks = parts["metrics"].sinks
    assert [type(s) for s in sinks] == [JsonlSink]  # ...so metrics.jsonl, always written, is the only one
    assert sinks[0].path == tmp_path / "none" / "metrics.jsonl"
    assert set(parts["trainer"].callbacks) - {"cpu_threads"} == {"qk_clip"}  # the rest of the run is the default's
    assert not (tmp_path / "none").exists()  # building writes nothing
    # Another logger adds its sink after metrics.jsonl's through the same path.
    _, parts = built_run(monkeypatch, tmp_path / "tb", tiny_data_dir, "logger=tensorboard")
    assert [type(s) for s in parts["metrics"].sinks] == [JsonlSink, TensorBoardSink]
