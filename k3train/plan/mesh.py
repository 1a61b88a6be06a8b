"""A mesh to plan for: how N devices divide the work, dp_replicate x dp_shard, with ep ranks splitting the routed
experts and cp ranks splitting each row's sequence. A Mesh is the run's ParallelLayout
(k3train/runtime/parallel_layout.py: the rules, world, expert_dp, expert_shard, expert_replicas, dp_size), so a
mesh the planner accepts is one a run accepts.

    world = dp_replicate x dp_shard          every rank holds its own tokens of the global batch
    ep | world / pp (ep | dp_shard under     groups of ep consecutive ranks of a stage split the routed experts:
      FSDP)                                  E / ep whole experts per rank, token slots exchanged by all-to-all
    cp | world                               groups of cp consecutive ranks split the same rows (parallel.cp): each
                                             holds seq_len / cp positions of them, so world / cp ranks read different
                                             rows (global batch: batch x world / cp rows)
    pp | world                               pp pipeline stages (parallel.pp), outermost: world / pp ranks hold
                                             each stage and are its dp_replicate x dp_shard (--mesh R x S x E x C
                                             x P; k3train/plan/pipeline.py plans a rank as a run of its stages)
Everything else (attention, the router, shared experts, dense FFN, embeddings) is data-parallel over every rank:
replicated (DDP, dp_shard = 1) or FSDP-sharded over dp_shard and replicated over dp_replicate (FSDP2, HSDP).
The routed experts: under DDP (k3train's parallel=ddp with parallel.ep, k3train/runtime/parallel_dims.py) each
rank keeps its E / ep whole and the world / ep ranks holding the same experts (a stage's ranks / ep under pp: the
other stages hold other layers) average their gradients; under FSDP
(parallel=fsdp with parallel.ep, as torchtitan does it) ep is carved out of dp_shard (ep | dp_shard) and each
rank's experts are FSDP-sharded over the dp_shard / ep ranks that hold the same ones, so ep changes where the
experts' bytes live and what moves rather than the bytes each rank stores: a layer's experts are gathered over
dp_shard / ep ranks, E / ep of them, not all E over every rank, and the tokens travel to their experts instead.
cp changes no parameter's placement (gradients still average over every rank: each rank's tokens are different
ones, k3train/runtime/parallel_dims.py), only the tokens a rank holds and what its KDA and MLA layers exchange.
"""

from __future__ import annotations

from k3train.runtime.parallel_layout import ParallelLayout


class Mesh(ParallelLayout):
    """A ParallelLayout (its rules and sizes are the run's: k3train/runtime/parallel_layout.py) with the planner's
    text form: --mesh parses one, a plan prints one."""

    @classmethod
    def parse(cls, text: str, cp: int = 1, pp: int = 1) -> Mesh:
        """'R x S x E x C x P' (or 'RxSxExC', pp `pp`; 'RxSxE', cp `cp` too; 'RxS', ep 1 too), e.g. '1x1024x64',
        '1x1024x64x8' or '1x128x64x1x8' (8 pipeline stages, each over 1 x 128 ranks)."""
        parts = text.lower().replace(" ", "").split("x")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) not in (2, 3, 4, 5):
            raise ValueError(
                f"--mesh {text!r}: write dp_replicate x dp_shard x ep [x cp [x pp]], e.g. 1x1024x64, 1x1024x64x8, "
                "1x128x64x1x8"
            )
        if len(values) == 2:
            values.append(1)
        if len(values) == 3:
            values.append(cp)
        if len(values) == 4:
            values.append(pp)
        mesh = cls(*values)
        if mesh.stage_world % mesh.ep:
            raise ValueError(f"--mesh {text!r}: ep={mesh.ep} must divide a stage's {mesh.stage_world} ranks")
        return mesh

    @property
    def stage(self) -> Mesh:
        """The ranks of one pipeline stage (the whole mesh without pp)."""
        return Mesh(self.dp_replicate, self.dp_shard, self.ep, self.cp)

    def describe(self) -> str:
        cp = f", cp {self.cp}" if self.cp > 1 else ""
        dp = f"dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} (ep {self.ep}{cp})"
        return f"pp {self.pp} stages, each {dp}" if self.pp > 1 else dp

    def __str__(self) -> str:
        cp = f"x{self.cp}" if self.cp > 1 or self.pp > 1 else ""
        pp = f"x{self.pp}" if self.pp > 1 else ""
        return f"{self.dp_replicate}x{self.dp_shard}x{self.ep}{cp}{pp}"


def candidates(devices: int, n_experts: int, cp: int = 1, pp: int = 1) -> list[Mesh]:
    """The meshes a proposal tries, in order, taking the first that fits: DDP (replicated, ep 1), DDP with ep = 2,
    4, ... (parallel=ddp parallel.ep), then FSDP over every device with ep = 1, 2, 4, ...: powers of
    two dividing the devices and the experts; every one with the cp asked for (1 unless the user asks) and the pp
    configured (the devices / pp of a stage are what DDP or FSDP spans)."""
    n = devices // pp
    eps = [ep for ep in _powers_of_two(n) if n % ep == 0 and n_experts % ep == 0]
    return [Mesh(n, 1, ep, cp, pp) for ep in eps] + [Mesh(1, n, ep, cp, pp) for ep in eps]


def _powers_of_two(limit: int) -> list[int]:
    out, ep = [], 1
    while ep <= limit:
        out.append(ep)
        ep *= 2
    return out


# How torch.chunk (and DTensor's Shard) splits `size` rows over `parts` ranks, rank by rank, without the list of every
# rank's (k3train/runtime/distributed.chunk_sizes): a plan for a billion devices asks about a few ranks, not all.
def rank_rows(size: int, parts: int, rank: int) -> int:
    """chunk_sizes(size, parts)[rank]: ceil(size / parts) rows, the last ranks fewer or none."""
    step = -(-size // parts)
    return max(0, min(step, size - rank * step))


def row_breaks(size: int, parts: int) -> tuple[int, int]:
    """The ranks where rank_rows(size, parts, .) changes: the first with fewer than ceil(size / parts) rows, and the
    first with none after it. Rows never grow with the rank, so rank 0 holds the most."""
    step = -(-size // parts)
    full = size // step if step else 0
    return full, full + 1
