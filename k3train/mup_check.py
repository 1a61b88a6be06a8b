"""python -m k3train.mup_check: muP's coordinate check for a KimiK3 family (k3train/models/k3/mup.py).

    python -m k3train.mup_check [--model k3_tiny] [--widths 32,64,128,256] [--steps 3] [--lr 0.01] [--out DIR]
    python -m k3train.mup_check --depths 2,4,8,16 ...   (depth at the option's width instead)

For each parametrization (mup, then standard) and each width of the model option's family (KimiK3Config.at_width:
heads, latent ranks and FFN widths scaled with d_model), trains `steps` updates of muon_adamw at a constant lr on
one batch of the built-in corpus, from the same seed, and after each update measures per layer type (the embedding,
the KDA and MLA mixers, the dense and MoE FFNs, the logits) the RMS of its output on that batch and the RMS of the
output's change since initialisation. Under muP both stay of one size at every width; under standard they grow
with it (Tensor Programs V, arXiv 2203.03466, section 7: the coordinate check). The spread of a layer type is its
largest RMS over its smallest across the widths, after the last update. With --depths the members differ in
n_layers instead, at the option's width (CompleteP's check, arXiv 2505.01618).

Writes DIR/mup_check.json (every figure, the CPU and the spreads) and DIR/mup_check.png (RMS against width, one
panel per parametrization); prints the spreads. Exit status 0 when every spread under mup is below --tolerance (2),
1 when one is not, 2 for bad input.
"""

from __future__ import annotations

from k3train.runtime.bootstrap import bootstrap

bootstrap()  # before anything loads torch (runtime/bootstrap.py)

import argparse
import json
import math
import platform
import sys
from collections import defaultdict
from pathlib import Path

import torch

from k3train.config import option
from k3train.data.builtin import builtin_documents
from k3train.drawing import new_figure
from k3train.models.k3 import KimiK3
from k3train.models.k3.config import KimiK3Config
from k3train.models.k3.moe import MoE

PARAMETRIZATIONS = ("mup", "standard")
VOCAB = 257  # bytes and the end-of-document token


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m k3train.mup_check",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="k3_tiny", help="a conf/model option of the KimiK3 family (k3_tiny)")
    parser.add_argument("--widths", default="32,64,128,256", help="d_model of each member, comma-separated")
    parser.add_argument("--depths", help="n_layers of each member, comma-separated, at the option's width")
    parser.add_argument("--steps", type=int, default=3, help="updates before the last measurement (3)")
    parser.add_argument("--lr", type=float, default=1e-2, help="muon_adamw's lr, constant (1e-2)")
    parser.add_argument("--batch", type=int, default=4, help="rows of the one batch every update trains on")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens a row")
    parser.add_argument("--tolerance", type=float, default=2.0, help="the largest spread mup may show (2)")
    parser.add_argument("--out", type=Path, default=Path("mup_check"), help="folder for the JSON and the figure")
    args = parser.parse_args(argv)
    axis = "n_layers" if args.depths else "d_model"
    try:
        sizes = [int(w) for w in (args.depths or args.widths).split(",")]
        if len(sizes) < 2 or min(sizes) <= 0:
            raise ValueError(f"--{'depths' if args.depths else 'widths'}: give two or more positive sizes")
        if args.steps < 1 or not args.lr > 0:
            raise ValueError("--steps must be >= 1 and --lr > 0")
        config = family_config(args.model)
        members = [member(config, axis, size) for size in sizes]  # every member must exist before any is trained
    except ValueError as e:
        print(f"mup_check: error: {e}", file=sys.stderr)
        return 2
    result = coordinate_check(members, axis, args.steps, args.lr, args.batch, args.seq_len)
    result |= {"model": args.model, "tolerance": args.tolerance, "cpu": platform.processor() or platform.machine()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mup_check.json").write_text(json.dumps(result, indent=2) + "\n")
    draw(result, args.out / "mup_check.png")
    print(render(result))
    print(f"wrote {args.out / 'mup_check.json'} and {args.out / 'mup_check.png'}")
    return 0 if max(result["spread"]["mup"].values()) < args.tolerance else 1


def family_config(model: str) -> KimiK3Config:
    """The model option's KimiK3Config with the byte vocabulary; ValueError for a family other than KimiK3."""
    node = option("model", model)
    target = str(node.get("_target_", ""))
    if not target.startswith("k3train.models.k3."):
        raise ValueError(f"--model={model} ({target}) has no muP parametrization: give a KimiK3 option (k3_tiny, ...)")
    fields = {k: v for k, v in node.items() if k != "_target_"}
    return KimiK3Config(**(fields | {"vocab_size": VOCAB}))


def member(config: KimiK3Config, axis: str, size: int) -> KimiK3Config:
    """The family member of `config` at d_model (heads and widths scaled with it) or n_layers `size`."""
    if axis == "d_model":
        return config.at_width(size)
    return KimiK3Config(**(vars(config) | {"n_layers": size, "first_k_dense": min(config.first_k_dense, size)}))


def batch(n_rows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n_rows * seq_len + 1 bytes of the built-in corpus as inputs and next-byte targets."""
    data = torch.tensor(list("\n".join(builtin_documents()).encode()[: n_rows * seq_len + 1]))
    return data[:-1].view(n_rows, seq_len), data[1:].view(n_rows, seq_len)


def coordinate_check(
    members: list[KimiK3Config],
    axis: str = "d_model",
    steps: int = 3,
    lr: float = 1e-2,
    n_rows: int = 4,
    seq_len: int = 64,
    seed: int = 0,
) -> dict:
    """{"sizes": each member's `axis` (d_model or n_layers), "rms": {parametrization: {size: [{layer type: rms}
    after each update, init first]}}, "delta_rms": the same for the change since init, "spread": {parametrization:
    {layer type: largest over smallest rms at the last step}}}."""
    from hydra.utils import instantiate

    optimizer_factory = instantiate(option("optim", "muon_adamw"), lr=lr)
    x, y = batch(n_rows, seq_len)
    sizes = [getattr(m, axis) for m in members]
    result: dict = {"axis": axis, "sizes": sizes, "steps": steps, "lr": lr, "rms": {}, "delta_rms": {}, "spread": {}}
    for parametrization in PARAMETRIZATIONS:
        rms, delta = {}, {}
        for size, config in zip(sizes, members):
            torch.manual_seed(seed)
            model = KimiK3(KimiK3Config(**(vars(config) | {"parametrization": parametrization})))
            optimizer = optimizer_factory(model)
            first = outputs(model, x)
            rms[size], delta[size] = [layer_rms(first)], [layer_rms({k: v * 0 for k, v in first.items()})]
            for _ in range(steps):
                model.train()
                _, loss = model(x, y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                now = outputs(model, x)
                rms[size].append(layer_rms(now))
                delta[size].append(layer_rms({k: now[k] - first[k] for k in now}))
        result["rms"][parametrization], result["delta_rms"][parametrization] = rms, delta
        last = [rms[size][-1] for size in sizes]
        result["spread"][parametrization] = {
            kind: max(r[kind] for r in last) / min(r[kind] for r in last) for kind in last[0]
        }
    return result


@torch.no_grad()
def outputs(model: KimiK3, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every measured module's output on x in eval mode, by name ("embedding", "logits", "3.mla", "3.moe", ...)."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [model.embed_tokens.register_forward_hook(lambda m, i, o: seen.__setitem__("embedding", o))]
    for i, layer in enumerate(model.layers):
        ffn = "moe" if isinstance(layer.ffn, MoE) else "dense_ffn"
        hooks.append(layer.mixer.register_forward_hook(keep(seen, f"{i}.{layer.mixer_type}")))
        hooks.append(layer.ffn.register_forward_hook(keep(seen, f"{i}.{ffn}")))
    model.eval()
    try:
        logits, _ = model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return seen | {"logits": logits}


def keep(seen: dict, name: str):
    return lambda module, inputs, output: seen.__setitem__(name, output)


def layer_rms(activations: dict[str, torch.Tensor]) -> dict[str, float]:
    """{layer type: RMS over every layer of that type} (the mean square averaged over the layers)."""
    squares = defaultdict(list)
    for name, a in activations.items():
        squares[name.rpartition(".")[2]].append(float(a.double().square().mean()))
    return {kind: math.sqrt(sum(s) / len(s)) for kind, s in squares.items()}


def render(result: dict) -> str:
    kinds = list(result["spread"]["mup"])
    lines = [
        f"spread of the RMS over {result['axis']} {result['sizes']} after {result['steps']} updates "
        "(largest / smallest):"
    ]
    lines.append(f"{'':10}" + "".join(f"{k:>11}" for k in kinds))
    for parametrization, spread in result["spread"].items():
        lines.append(f"{parametrization:10}" + "".join(f"{spread[k]:>11.2f}" for k in kinds))
    return "\n".join(lines)


def draw(result: dict, path: Path) -> None:
    fig = new_figure(path, figsize=(11, 8), layout="constrained")
    if fig is None:
        return
    axes = fig.subplots(2, 2, sharex=True)
    sizes = result["sizes"]
    for col, parametrization in enumerate(PARAMETRIZATIONS):
        for row, (key, label) in enumerate((("rms", "output RMS"), ("delta_rms", "RMS of the change since init"))):
            ax = axes[row][col]
            for kind in result["spread"][parametrization]:
                ax.plot(sizes, [result[key][parametrization][s][-1][kind] for s in sizes], marker="o", label=kind)
            ax.set(xscale="log", yscale="log", title=f"{parametrization}: {label}", xlabel=result["axis"])
            ax.set_xticks(sizes, [str(s) for s in sizes])
            ax.minorticks_off()
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"coordinate check after {result['steps']} updates at lr {result['lr']:g}")
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
