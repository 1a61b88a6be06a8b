"""`python -m k3train.plan [overrides] [--gpus N] --gpu h200|h100|b200|cpu`: size a run before asking for hardware.

The overrides are `python -m k3train`'s: the config is composed by Hydra's compose API from the same conf/ and
schema (what `python -m k3train OVERRIDES --cfg job` shows), the model is built on the meta device (no weight is
allocated; model=k3 takes seconds). Prints memory per device, communication per step, step time and throughput for
a mesh, the one given (--mesh) or the one proposed for N devices: the fastest that fits, or with --prefer memory the
one with the smallest peak (splitting each row over --cp ranks, or the config's parallel.cp, when asked); exit 2
when nothing fits (or the given mesh does not), with what is too large. It leads with the command that trains
what it shows (python -m k3train, torchrun or srun, k3train/plan/command.py), and says so when train.seq_len is a
quickstart's, far below the model's max_seq_len.

When the configured recipe fits nowhere on N devices, the recipes that do follow, fastest step first, each with
the command that trains it and the one that plans it: precision, activation checkpointing,
the micro-batch (with the accumulation that keeps the tokens a device trains on per step) and cp searched, on
every mesh; train.seq_len, the model, the optimizer and the global batch held (k3train/plan/search.py).
Without --gpus: the fewest devices, 1, 2, 4, ... up to 65,536 (a CPU: its cores), at which a recipe fits, planned;
exit 0 then, 2 when none does. --json prints the same as JSON. docs/plan.md.
"""

from k3train.runtime.bootstrap import bootstrap

bootstrap()  # before torch loads (runtime/bootstrap.py)

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

from hydra import compose, initialize_config_module  # noqa: E402
from hydra.errors import InstantiationException  # noqa: E402
from hydra.utils import instantiate  # noqa: E402

from k3train.config import register_configs  # noqa: E402
from k3train.plan.activations import cp_kda_refusal  # noqa: E402
from k3train.plan.estimate import PREFER, estimate, propose  # noqa: E402
from k3train.plan.hardware import CHOICES, lookup  # noqa: E402
from k3train.plan.mesh import Mesh  # noqa: E402
from k3train.plan.pipeline import plan_pipeline  # noqa: E402
from k3train.plan.report import as_json, render, run_json, run_lines, search_json, search_lines  # noqa: E402
from k3train.plan.search import Recipe, count_bound, overrides_for, search_recipes, smallest_count  # noqa: E402
from k3train.plan.settings import PlanSettings  # noqa: E402
from k3train.plan.spec import build_spec, check_split  # noqa: E402


def compose_config(overrides: list[str]):
    """The config `python -m k3train OVERRIDES` runs with (Hydra's compose API on the same package)."""
    register_configs()
    with initialize_config_module(config_module="k3train.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, as the plan's other refusals are (argparse's usage block would bury it)."""
        print(f"k3train plan: error: {message} (--help lists the options)", file=sys.stderr)
        raise SystemExit(2)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and each option's default where it has one (an unset option's None, or a flag's
    False, says nothing its help does not)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = Parser(
        prog="python -m k3train.plan",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=HelpFormatter,
    )
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m k3train (model=k3 ...)")
    ap.add_argument(
        "--gpus",
        type=int,
        help="devices (processes) of the run; without it, the fewest (1, 2, 4, ...) at which a recipe fits",
    )
    ap.add_argument("--gpu", choices=CHOICES, default="h200", help="the device (cpu: this machine, measured)")
    ap.add_argument("--mfu", type=float, default=PlanSettings.mfu, help="fraction of the peak FLOP/s the matmuls reach")
    ap.add_argument(
        "--mesh", help="dp_replicate x dp_shard x ep [x cp] (e.g. 1x1024x64, 1x1024x64x8) instead of the proposal"
    )
    ap.add_argument(
        "--prefer",
        choices=PREFER,
        default="step",
        help="the mesh proposed among those that fit: the shortest step, or the smallest peak memory",
    )
    ap.add_argument("--cp", type=int, help="split each row's sequence over this many ranks (default: parallel.cp)")
    ap.add_argument("--headroom", type=float, default=PlanSettings.headroom, help="fraction of device memory kept free")
    ap.add_argument("--vocab-size", type=int, help="for a model whose vocab_size is null (the data's)")
    ap.add_argument(
        "--storage-gbps",
        type=float,
        help="the checkpoint storage's write bandwidth per node, GB/s: the plan then gives the write's time",
    )
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    if args.gpus is not None and args.gpus < 1:
        ap.error("--gpus must be >= 1")
    if args.cp is not None and args.cp < 1:
        ap.error("--cp must be >= 1")
    if not 0 < args.mfu <= 1:
        ap.error("--mfu must be in (0, 1]")
    if not 0 <= args.headroom < 1:
        ap.error("--headroom must be in [0, 1)")
    if args.storage_gbps is not None and not args.storage_gbps > 0:
        ap.error("--storage-gbps must be > 0 (GB/s a node)")
    return args


def vocab_for(cfg, given: int | None) -> int | None:
    """The model's vocabulary when its YAML leaves it null: --vocab-size, else the data's (as the runner does)."""
    if cfg.model.get("vocab_size") is not None or given is not None:
        return given
    return instantiate(cfg.data).vocab_size


def notes_for(mesh: Mesh, spec) -> list[str]:
    """What running `mesh` takes in k3train's config."""
    notes = []
    if mesh.world > 1:
        want = f"parallel={'ddp' if mesh.dp_shard == 1 else 'fsdp'}"
        want += f" parallel.dp_replicate={mesh.dp_replicate}" if mesh.strategy == "hsdp" else ""
        want += f" parallel.ep={mesh.ep}" if mesh.ep > 1 else ""
        want += f" parallel.cp={mesh.cp}" if mesh.cp > 1 else ""
        have = f"parallel={spec.strategy}"
        have += f" parallel.dp_replicate={spec.dp_replicate}" if spec.dp_replicate > 1 else ""
        have += f" parallel.ep={spec.ep}" if spec.ep > 1 else ""
        have += f" parallel.cp={spec.cp}" if spec.cp > 1 else ""
        if want != have:
            notes.append(f"run it with {want} (the config says {have})")
    return notes


def check_pipeline(spec, fewest: bool) -> None:
    """A pipeline the run would refuse, refused in its words (one line): a schedule that does not exist, virtual
    stages it cannot hold, more stages than layers, micro-batches that do not divide the rows or are too few;
    tied embeddings (the first and last stages would share them); and no device count to plan at."""
    plan_pipeline(spec)
    if spec.model.tie_embeddings:
        raise ValueError(
            f"parallel.pp={spec.pp} with model.tie_embeddings=true: the embedding (first stage) and the LM head (last) "
            "cannot share a weight; untie them or set parallel.pp=1"
        )
    if fewest:
        raise ValueError(
            f"parallel.pp={spec.pp}: give --gpus N or --mesh (the search for the fewest devices does not vary a "
            "pipelined run)"
        )


def planner_flags(args: argparse.Namespace) -> list[str]:
    """The planner's own options a printed command repeats, so that it plans what this plan did."""
    flags = ["--gpu", args.gpu]
    if args.mfu != PlanSettings.mfu:
        flags += ["--mfu", str(args.mfu)]
    if args.headroom != PlanSettings.headroom:
        flags += ["--headroom", str(args.headroom)]
    if args.vocab_size is not None:
        flags += ["--vocab-size", str(args.vocab_size)]
    return flags


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit_:  # --help (0) or a bad option (2, said in one line): a status, as every refusal
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        cfg = compose_config(args.overrides)
        device_type = "cpu" if args.gpu == "cpu" else "cuda"
        spec = build_spec(cfg, device_type, vocab_for(cfg, args.vocab_size))
        hw = lookup(args.gpu)
        cp = spec.cp if args.cp is None else args.cp
        mesh = Mesh.parse(args.mesh, cp=cp, pp=spec.pp) if args.mesh else None
        if mesh is not None and args.cp is not None and mesh.cp != args.cp:
            raise ValueError(f"--mesh {mesh} splits rows over cp={mesh.cp} ranks, --cp {args.cp}")
        if mesh is not None and mesh.pp != spec.pp:
            raise ValueError(f"--mesh {mesh} has pp={mesh.pp} stages, the config parallel.pp={spec.pp}")
        cp = mesh.cp if mesh is not None else cp
        check_split(spec.seq_len, cp)
        if args.gpus is not None and args.gpus % (cp * spec.pp):
            raise ValueError(
                f"cp={cp} x pp={spec.pp} must divide the {args.gpus} devices: each row is split over cp ranks, and "
                "each pipeline stage is held by devices / pp of them"
            )
        if spec.pp > 1:
            check_pipeline(spec, args.gpus is None and mesh is None)
        if cp > 1 and "kda" in spec.model.layer_pattern and spec.model.kda_implementation != "chunk":
            raise ValueError(cp_kda_refusal(spec.model.kda_implementation))
    except Exception as exc:  # a bad override, model or mesh: say what, as a refusal
        cause = exc.__cause__ if isinstance(exc, InstantiationException) and exc.__cause__ else exc  # not Hydra's
        print(f"k3train plan: error: {cause}", file=sys.stderr)  # "Error in call to target" wrapper: its reason
        return 2
    devices = args.gpus if args.gpus is not None or mesh is None else mesh.world
    if mesh is not None and mesh.world != devices:
        print(f"k3train plan: error: --mesh {mesh} has {mesh.world} ranks, --gpus {devices}", file=sys.stderr)
        return 2
    cp_fixed = args.cp is not None or mesh is not None  # else the search may split rows further
    settings = PlanSettings(args.mfu, args.headroom, device_type, cp, cp_fixed)
    if devices is None:
        return plan_fewest(args, spec, hw, settings)
    if mesh is None:
        chosen, tried = propose(spec, devices, hw, settings, args.prefer)
    else:
        tried = [estimate(spec, mesh, hw, settings)]
        chosen = tried[0] if tried[0].fits else None
    search = None
    if chosen is None and spec.pp == 1:  # the configured recipe fits nowhere here: which recipes do
        search = search_recipes(spec, devices, hw, settings, mesh)
    shown = chosen or min(tried, key=lambda e: e.memory.peak)
    notes = notes_for(shown.mesh, spec)
    # what to run leads: this plan's command, else the fastest recipe that fits, else nothing
    fit = search.fits[0] if search is not None and search.fits else None
    if chosen is not None:
        run = (spec, chosen.mesh)
        title = f"train it (the plan below, {chosen.mesh}: {_pace(chosen)})"
    elif fit is not None:
        run = (fit.spec, fit.estimate.mesh)
        title = (
            f"the configured recipe fits on no mesh of {devices:,}; train the fastest recipe that does "
            f"({fit.recipe.describe()}, {fit.estimate.mesh}: {_pace(fit.estimate)}; listed below)"
        )
    else:
        run, title = None, None
    storage = _storage(args)
    if args.json:
        plan = as_json(spec, hw, chosen, tried, args.mfu, storage)
        plan["prefer"] = args.prefer
        plan["run"] = None if run is None else run_json(*run, devices, hw, args.overrides)
        if search is not None:
            plan["search"] = search_json(search, spec, args.overrides, hw)
        print(json.dumps(plan, indent=2))
    else:
        lead = ["nothing fits: no command to run (below: the smallest peak and what is too large)"]
        if run is not None:
            lead = run_lines(title, *run, devices, hw, args.overrides)
        text = render(
            spec, hw, devices, args.overrides, chosen, tried, args.mfu, mesh is None, notes, lead, args.prefer, storage
        )
        if search is not None:
            text += "\n" + "\n".join(search_lines(search, spec, args.overrides, planner_flags(args), hw))
        print(text)
    if chosen is None:
        if search is None:
            tail = " (the recipe search does not vary a pipelined run: plan it with other overrides, or pp 1)"
        else:
            tail = "; the recipes listed fit" if search.fits else ", nor does any recipe searched"
        print(f"k3train plan: nothing fits on {devices} x {hw.name} (exit 2){tail}", file=sys.stderr)
        return 2
    return 0


def plan_fewest(args: argparse.Namespace, spec, hw, settings: PlanSettings) -> int:
    """No --gpus: the fewest devices at which a recipe fits (search.smallest_count), planned; the configured recipe
    where it fits there, else the fastest that does, with the others listed."""
    found, searches = smallest_count(spec, hw, settings)
    bound, cp = count_bound(settings.device_type), settings.cp
    counts = f"1, 2, 4, ..., {bound:,} devices" + (f" that cp {cp} divides" if cp > 1 else "")
    if found is None:
        if args.json:
            print(json.dumps({"device": hw.name, "devices": None, "counts_tried": [s.devices for s in searches]}))
        else:
            print(f"k3train plan: {' '.join(args.overrides) or '(defaults)'}: no recipe searched fits on {counts}")
        print(f"k3train plan: nothing fits on up to {bound:,} x {hw.name} (exit 2)", file=sys.stderr)
        return 2
    devices = found.devices
    configured = next((f for f in found.fits if f.recipe == configured_recipe(spec, cp)), None)
    fewer = f"; on {searches[-2].devices:,} none did" if len(searches) > 1 else ""
    lines = [f"fewest devices: {devices:,} x {hw.name}, the first of {counts} at which a recipe searched fits{fewer}"]
    if configured is not None:  # as --gpus N plans it: the proposal, its mesh and the meshes tried
        chosen, tried = propose(spec, devices, hw, settings, args.prefer)
        plan_spec, overrides, notes = spec, args.overrides, notes_for(chosen.mesh, spec)
    else:  # the configured recipe fits on no mesh here: the fastest recipe that does, as its command plans it
        best = found.fits[0]
        chosen, tried = best.estimate, [best.estimate]
        plan_spec, overrides = best.spec, overrides_for(best, spec, args.overrides)
        lines.append(
            f"  the configured recipe ({configured_recipe(spec, cp).describe()}) fits on no mesh of {devices:,}; "
            f"planned below: the fastest recipe that does, at its fastest mesh"
        )
        notes = []
    if args.json:
        plan = as_json(plan_spec, hw, chosen, tried, args.mfu, _storage(args))
        plan.update(devices=devices, overrides=overrides, search=search_json(found, spec, args.overrides, hw))
        plan.update(prefer=args.prefer, run=run_json(plan_spec, chosen.mesh, devices, hw, args.overrides))
        print(json.dumps(plan, indent=2))
        return 0
    title = f"train it (the plan below, {chosen.mesh}: {_pace(chosen)})"
    lead = run_lines(title, plan_spec, chosen.mesh, devices, hw, args.overrides)
    proposed = configured is not None
    text = [*lines, ""]
    storage = _storage(args)
    text.append(
        render(plan_spec, hw, devices, overrides, chosen, tried, args.mfu, proposed, notes, lead, args.prefer, storage)
    )
    if configured is None:
        text += search_lines(found, spec, args.overrides, planner_flags(args), hw)
    print("\n".join(text))
    return 0


def _storage(args: argparse.Namespace) -> float | None:
    """--storage-gbps in bytes a second, or None."""
    return args.storage_gbps * 1e9 if args.storage_gbps else None


def _pace(e) -> str:
    """A plan's step and what it takes to train 1e12 tokens."""
    return (
        f"{e.step_s:,.3g} s a step, {e.tokens_per_day:.3e} tokens/day, {e.days_per_trillion:,.1f} days per 1e12 tokens"
    )


def configured_recipe(spec, cp: int) -> Recipe:
    return Recipe(spec.precision, spec.checkpointing, spec.batch_size, spec.accumulation, cp)


if __name__ == "__main__":
    sys.exit(main())
