"""Document masking (data.document_masking): the loader marks where documents start, and a row of packed documents
then trains as each document alone would.

The equivalence, precisely: for every document at positions [s, e) of row b, the per-token losses at s..e-1 of the
packed batch (inputs x, targets y) equal those of x[b, s:e] run alone with targets y[b, s:e]. Every position is
compared, the document's last one included: after an end-of-document token its target is the next document's first
token, and that target stays in the loss (loader.py says why), in the packed row and alone alike. Gradients: those
of the packed batch's summed per-token losses equal the sum over its documents of theirs. <= 1e-10 in fp64, 1e-5 in
fp32. Boundaries fall on a KDA chunk edge, inside a chunk, one position in (a row that begins with an end-of-document
token, so its first document is that one token) and one before the end; a row of one document is today's path, bit
for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3train.data import TokenData, TokenDataLoader
from k3train.data.loader import document_ids
from k3train.evaluate import data_config
from k3train.models.common.attention import _document_tiles, causal_attention, document_attention
from k3train.models.common.documents import block_causal_mask, cu_seqlens
from k3train.models.k3.mla import MultiHeadLatentAttention, causal_max_logit
from k3train.models.kda import chunk_kda, naive_recurrent_kda
from k3train.models.kda.fla import _fla_chunk_kda_documents
from k3train.models.kda.layer import CausalConvSiLU
from k3train.models.smoke import SmokeTestConfig, SmokeTestLM

from helpers.kda_problems import NAMES, make_inputs, run
from helpers.tiny_k3 import V, tiny_model
from helpers.trainer import WrapsSmoke, make_trainer

pytestmark = pytest.mark.usefixtures("one_thread")

T = 64  # tiny_k3's max_seq_len, 4 KDA chunks of 16
# Row 0: starts at 16 (a chunk edge), 21 and 22 (inside a chunk: a one-token document), 42, and 63 (the last
# position alone). Row 1: a one-token document at position 0 (the row begins with an eod), then 32 (a chunk edge).
LENGTHS = [[16, 5, 1, 20, 21, 1], [1, 31, 32]]
K3_PARTS = dict(
    attn_res_block_size=2, ffn_activation="situ", expert_latent_dim=16, mla_output_gate=True,
    kda_output_gate="full_rank", kda_gate="sigmoid",
)  # fmt: skip
MODELS = {"kda_only": dict(kda_mla_ratio="1:0"), "mla_only": dict(kda_mla_ratio="0:1"), "k3": K3_PARTS}


def ids_of(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


def spans(lengths: list[list[int]]):
    """(row, start, stop) of every document."""
    for b, row in enumerate(lengths):
        start = 0
        for length in row:
            yield b, start, start + length
            start += length


# ---- the loader ------------------------------------------------------------------------------------------------


def test_the_token_after_an_eod_starts_a_document_and_its_target_stays(tiny_data_dir) -> None:
    x = torch.tensor([[5, 256, 7, 8, 256, 256, 9], [1, 2, 3, 4, 5, 6, 256]])
    assert document_ids(x, 256).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0] * 7]  # an eod last in a row starts none there
    assert document_ids(x[1:], 256) is None  # nothing to mask: no ids at all

    data = TokenData(tiny_data_dir)  # documents end with 256 (the byte tokenizer's eod)
    train, _ = data.loaders(1, 64)  # the val split holds 73 tokens
    x, y, ids = train.next_batch()
    assert ids is not None and torch.equal(ids, document_ids(x, 256))
    assert torch.equal(ids[:, 1:] - ids[:, :-1], (x[:, :-1] == 256).long())  # +1 right after each eod
    assert torch.equal(x[:, 1:], y[:, :-1])  # the targets are untouched: the eod's target is the next document's start
    off, _ = TokenData(tiny_data_dir, document_masking=False).loaders(1, 64)
    assert off.next_batch().document_ids is None


def test_the_loader_state_pins_document_masking_and_an_older_state_resumes_either_way(tiny_data_dir) -> None:
    data = TokenData(tiny_data_dir)
    on = TokenDataLoader(data.train, 2, 16, eod_id=256)
    off = TokenDataLoader(data.train, 2, 16)
    on.next_batch()
    with pytest.raises(ValueError, match="document_masking: saved True, this loader has False"):
        off.load_state_dict(on.state_dict())
    old = {k: v for k, v in on.state_dict().items() if k != "document_masking"}  # written before the setting
    for loader in (on, off):
        loader.load_state_dict(old)
        assert loader.cursor == 32


# ---- the kernels -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("decay", [1.0, 40.0], ids=["factored_blocks", "doubling_levels_only"])
def test_chunk_kda_restarts_the_state_at_each_document(decay) -> None:
    """Outputs, final states and every gradient (the initial state's too: a row's first document continues it)
    against the per-step reference run on each document alone, and against the reference's own document path."""
    ids = ids_of(LENGTHS)
    inputs = make_inputs(2, T, 2, 4, 8, 8, decay=decay)
    packed = run(chunk_kda, inputs, chunk_size=16, document_ids=ids)
    assert_equal_within(packed, run(naive_recurrent_kda, inputs, document_ids=ids), 1e-10)
    for b, start, stop in spans(LENGTHS):
        alone = [x[b : b + 1, start:stop].detach().requires_grad_() for x in inputs[:5]]
        h0 = inputs[5][b : b + 1].detach().requires_grad_() if start == 0 else None
        o, state = naive_recurrent_kda(*alone, initial_state=h0, output_final_state=True)
        torch.testing.assert_close(packed["o"][b : b + 1, start:stop], o, rtol=0, atol=1e-10)
        if stop == T:  # the row's last document leaves the final state
            torch.testing.assert_close(packed["final_state"][b : b + 1], state, rtol=0, atol=1e-10)


def assert_equal_within(result: dict, reference: dict, tol: float) -> None:
    for name in NAMES:
        torch.testing.assert_close(result[name], reference[name], rtol=0, atol=tol, msg=name)


def test_the_short_conv_reads_zeros_before_a_document_start() -> None:
    ids = ids_of(LENGTHS)
    x = torch.randn(2, T, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 1, 4, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, T, 6, dtype=torch.float64)
    packed = CausalConvSiLU.apply(x, weight, ids)
    grads = torch.autograd.grad((packed * upstream).sum(), (x, weight))
    alone_grad_w = torch.zeros_like(weight)
    for b, start, stop in spans(LENGTHS):
        piece = x[b : b + 1, start:stop]
        out = CausalConvSiLU.apply(piece, weight)
        torch.testing.assert_close(packed[b : b + 1, start:stop], out, rtol=0, atol=1e-12)
        gx, gw = torch.autograd.grad((out * upstream[b : b + 1, start:stop]).sum(), (piece, weight))
        torch.testing.assert_close(grads[0][b : b + 1, start:stop], gx, rtol=0, atol=1e-12)
        alone_grad_w += gw
    torch.testing.assert_close(grads[1], alone_grad_w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("with_state", [False, True], ids=["from_zero", "from_an_initial_state"])
def test_the_fla_path_hands_flas_varlen_kernel_one_flattened_row_and_cu_seqlens(with_state) -> None:
    """FLA needs CUDA: a stand-in with chunk_kda's varlen contract (batch 1, one sequence per cu_seqlens span, each
    from its own initial state, zero without one) checks what fla.py hands it and how it reads the answer back; an
    initial state [B, ...] goes to each row's first document, as the reference has it."""
    ids = ids_of(LENGTHS)
    assert cu_seqlens(ids).tolist() == [0, 16, 21, 22, 42, 63, 64, 65, 96, 128]
    calls = []

    def varlen_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
        calls.append((q.shape, cu_seqlens.tolist(), None if initial_state is None else initial_state.shape[0]))
        outs, states = [], []
        for n, (start, stop) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            o, s = naive_recurrent_kda(
                *(x[:, start:stop] for x in (q, k, v, g, beta)),
                initial_state=None if initial_state is None else initial_state[n : n + 1],
                output_final_state=True,
            )
            outs.append(o)
            states.append(s)
        return torch.cat(outs, dim=1), torch.cat(states)

    q, k, v, g, beta, h0 = make_inputs(2, T, 2, 2, 8, 8, with_state=with_state)
    o, final = _fla_chunk_kda_documents(varlen_chunk_kda, q, k, v, g, beta, None, h0, True, ids)
    reference, reference_final = naive_recurrent_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, document_ids=ids
    )
    assert calls == [((1, 2 * T, 2, 8), cu_seqlens(ids).tolist(), 9 if with_state else None)]
    torch.testing.assert_close(o, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, reference_final, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "min_tile", [1, 20, 256, None], ids=["per_document", "tiles_of_20", "one_tile_per_row", "dense_mask_off_cpu"]
)
def test_mla_attends_within_each_document_however_the_rows_are_tiled(min_tile) -> None:
    """The CPU's tiles, any size, and the one dense-mask call other devices make (run here on the CPU)."""
    ids = ids_of(LENGTHS)
    q, k = torch.randn(2, 3, T, 12, dtype=torch.float64), torch.randn(2, 3, T, 12, dtype=torch.float64)
    v = torch.randn(2, 3, T, 6, dtype=torch.float64)  # dv < dk: the CPU path pads it
    for t in (q, k, v):
        t.requires_grad_()
    visible = (ids[:, None, :, None] == ids[:, None, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    reference = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~visible, float("-inf")).softmax(-1) @ v
    if min_tile is None:
        out = causal_attention(q, k, v, 0.3, block_causal_mask(ids).unsqueeze(1))
    else:
        out = document_attention(q, k, v, 0.3, ids, min_tile=min_tile)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)
    upstream = torch.randn_like(out)
    for got, want in zip(
        torch.autograd.grad((out * upstream).sum(), (q, k, v)),
        torch.autograd.grad((reference * upstream).sum(), (q, k, v)),
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_tiles_group_short_documents_and_leave_a_long_one_alone() -> None:
    tiles = [(0, 21, 2), (21, 22, 1), (22, 42, 1), (42, 63, 1), (63, 64, 1)]  # (start, stop, documents)
    assert _document_tiles([16, 5, 1, 20, 21, 1], 20) == tiles
    assert _document_tiles([64, 20, 100, 200, 40, 600], 512) == [(0, 424, 5), (424, 1024, 1)]
    assert _document_tiles([30, 30, 30], 512) == [(0, 90, 3)]


def test_qk_clip_measures_only_the_logits_attention_computes() -> None:
    ids = ids_of(LENGTHS)
    q, k = torch.randn(2, 3, T, 8), torch.randn(2, 3, T, 8)
    q[1, :, 40], k[1, :, 10] = 50.0, 50.0  # a huge logit across row 1's documents (keys 0..31, queries 32..63)
    assert causal_max_logit(q, k, 0.5).min() > 1000
    visible = (ids[:, :, None] == ids[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    logits = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~visible[:, None], float("-inf"))
    torch.testing.assert_close(causal_max_logit(q, k, 0.5, ids), logits.amax(dim=(0, 2, 3)))


# ---- models ----------------------------------------------------------------------------------------------------


def per_token_losses_and_grads(model, x, y, ids=None, scale: float = 1.0):
    logits, _ = model(x) if ids is None else model(x, document_ids=ids)
    losses = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(losses.sum() * scale, params, allow_unused=True)
    return losses.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


@pytest.mark.parametrize(
    "name,dtype,tol",
    [*((name, torch.float64, 1e-10) for name in MODELS), ("k3", torch.float32, 1e-5)],
    ids=[*(f"{name}_fp64" for name in MODELS), "k3_fp32"],
)
def test_a_packed_row_trains_as_each_document_alone(name, dtype, tol) -> None:
    """Training mode; the router bias (which each training forward moves) is put back before every forward."""
    model = tiny_model(0, **MODELS[name]).to(dtype)
    start_state = {key: value.clone() for key, value in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, V, (2, T), generator=gen) for _ in range(2))
    scale = 1 / x.numel()  # the mean over the batch, as training takes it
    losses, grads = per_token_losses_and_grads(model, x, y, ids_of(LENGTHS), scale)
    summed = [torch.zeros_like(g) for g in grads]
    for b, start, stop in spans(LENGTHS):
        model.load_state_dict(start_state)
        alone, alone_grads = per_token_losses_and_grads(model, x[b : b + 1, start:stop], y[b : b + 1, start:stop])
        torch.testing.assert_close(losses[b : b + 1, start:stop], alone, rtol=0, atol=tol)
        for total, g in zip(summed, alone_grads):
            total += g * scale
    for (param, _), got, want in zip(named_trainable(model), grads, summed):
        torch.testing.assert_close(got, want, rtol=0, atol=tol, msg=param)


def named_trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("name", MODELS)
def test_one_document_per_row_is_todays_path_bitwise(name) -> None:
    """No boundary: the loader hands no ids (None), which is today's call; ids that mark one document per row take
    the masked path and still give the same bits."""
    model = tiny_model(0, **MODELS[name])
    start_state = {key: value.clone() for key, value in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, V, (2, T), generator=gen) for _ in range(2))
    today = per_token_losses_and_grads(model, x, y)
    for ids in (None, torch.zeros_like(x)):
        model.load_state_dict(start_state)
        logits, _ = model(x, document_ids=ids)
        losses = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
        grads = torch.autograd.grad(losses.sum(), [p for _, p in named_trainable(model)], allow_unused=True)
        assert torch.equal(losses.detach(), today[0])
        assert all(torch.equal(g if g is not None else torch.zeros_like(w), w) for g, w in zip(grads, today[1]))


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_activation_checkpointing_passes_the_documents_through(mode) -> None:
    gen = torch.Generator().manual_seed(2)
    x, y = (torch.randint(0, V, (2, T), generator=gen) for _ in range(2))
    results = {}
    for checkpointing in ("none", mode):
        model = tiny_model(0, **K3_PARTS).double()
        model.set_activation_checkpointing(checkpointing)
        _, loss = model(x, targets=y, document_ids=ids_of(LENGTHS))
        loss.backward()
        results[checkpointing] = (loss.detach(), {n: p.grad for n, p in named_trainable(model)})
    torch.testing.assert_close(results[mode][0], results["none"][0], rtol=0, atol=1e-12)
    for key, grad in results["none"][1].items():
        torch.testing.assert_close(results[mode][1][key], grad, rtol=0, atol=1e-12, msg=key)


# ---- the documents' forms, made once per forward ------------------------------------------------------------------
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")


def host_reads_and_masks(monkeypatch, model, x, y, ids) -> tuple[int, int]:
    """(host reads of a tensor's values, block-causal masks built) in one training forward + backward."""
    import k3train.models.common.attention as attention_module
    import k3train.models.common.documents as documents_module

    counts = {"reads": 0, "masks": 0}

    def counting(fn, key):
        def counted(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)

        return counted

    with monkeypatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name), "reads"))
        for name in ("nonzero", "unique_consecutive"):
            patch.setattr(torch, name, counting(getattr(torch, name), "reads"))
        for module in (attention_module, documents_module):
            if hasattr(module, "block_causal_mask"):
                patch.setattr(module, "block_causal_mask", counting(module.block_causal_mask, "masks"))
        _, loss = model(x, targets=y, document_ids=ids)
        loss.backward()
    return counts["reads"], counts["masks"]


@pytest.mark.parametrize("mode", ["none", "selective"])
def test_host_reads_and_masks_per_forward_do_not_grow_with_the_layers(monkeypatch, mode) -> None:
    """The forms a layer reads (MLA's tiles and their masks, FLA's cu_seqlens) come from one Documents per forward:
    the host reads that documents add (those with ids less those without: the MoE and KDA's chunked kernel read
    their own, per layer, either way), and the masks built, are the same at 2 and 4 layers of each kind, and a
    recompute under selective checkpointing makes none again."""
    gen = torch.Generator().manual_seed(3)
    x, y = (torch.randint(0, V, (2, T), generator=gen) for _ in range(2))
    ids = ids_of(LENGTHS)
    added, masks = [], []
    for n_layers in (4, 8):
        model = tiny_model(0, **{**K3_PARTS, "kda_mla_ratio": "1:1", "n_layers": n_layers})
        model.set_activation_checkpointing(mode)
        with_ids = host_reads_and_masks(monkeypatch, model, x, y, ids)
        without = host_reads_and_masks(monkeypatch, model, x, y, None)
        added.append(with_ids[0] - without[0])
        masks.append(with_ids[1])
    assert added[0] == added[1] <= 2, added  # cu_seqlens' nonzero and its one tolist: MLA's tiles
    assert masks[0] == masks[1], masks


def test_the_model_builds_one_documents_per_forward_and_every_layer_reads_it(monkeypatch) -> None:
    from k3train.models.common.documents import Documents

    built, seen = [], []
    real_init = Documents.__init__

    def init(self, *args, **kwargs):
        built.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(Documents, "__init__", init)
    model = tiny_model(0, **K3_PARTS)
    for layer in model.layers:
        layer.mixer.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
    model.set_activation_checkpointing("block")  # the recompute in the backward reads the same one
    gen = torch.Generator().manual_seed(4)
    x, y = (torch.randint(0, V, (2, T), generator=gen) for _ in range(2))
    _, loss = model(x, targets=y, document_ids=ids_of(LENGTHS))
    loss.backward()
    assert len(built) == 1 and torch.equal(built[0].ids, ids_of(LENGTHS))
    assert len(seen) == 2 * len(model.layers) and all(documents is built[0] for documents in seen)
    assert built[0].lengths == LENGTHS


def test_under_context_parallelism_the_ids_are_gathered_once_per_forward() -> None:
    """Every rank's ids are exchanged once, by the forward's Documents, not by each layer (MLA's keys, KDA's conv
    windows and slice ends all read them); a rank of 2 in one process, its peer's share a copy of its own."""
    from dataclasses import dataclass

    from k3train.models.common.context_parallel import ContextParallel, set_context_parallel

    gathered = []

    @dataclass(frozen=True)
    class SecondOfTwo(ContextParallel):
        rank: int = 1
        size: int = 2

        def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
            if not t.is_floating_point():
                gathered.append(t)
            return [t.clone(), t]

    for n_layers in (4, 8):
        gathered.clear()
        model = tiny_model(0, **{**K3_PARTS, "kda_mla_ratio": "1:1", "n_layers": n_layers})
        assert set_context_parallel(model, SecondOfTwo(None))
        with torch.no_grad():
            model(torch.zeros(2, T // 2, dtype=torch.long), document_ids=ids_of(LENGTHS)[:, T // 2 :])
        assert len(gathered) == 1, n_layers


def test_with_rope_a_packed_document_keeps_its_row_positions_and_attends_as_alone() -> None:
    """Positions count from the row's start, not the document's: rotary scores depend on i - j only, so a document
    attends as it would alone, up to the rounding of the rotary table's angles (fp32) at other positions."""
    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(16, 2, 8, 8, 4, 8, rope=True, max_seq_len=T, output_gate=True).double()
    x = torch.randn(2, T, 16, dtype=torch.float64)
    packed = mla(x, ids_of(LENGTHS))
    for b, start, stop in spans(LENGTHS):
        torch.testing.assert_close(packed[b : b + 1, start:stop], mla(x[b : b + 1, start:stop]), rtol=0, atol=1e-6)


def test_the_smoke_model_takes_the_documents_and_needs_nothing_done() -> None:
    model = SmokeTestLM(SmokeTestConfig(vocab_size=V, d_model=8))
    x = torch.randint(0, V, (2, T))
    assert torch.equal(model(x, document_ids=ids_of(LENGTHS))[0], model(x)[0])  # logits at t read token t alone


# ---- training and evaluation -----------------------------------------------------------------------------------


class RecordsDocuments(SmokeTestLM):
    def __init__(self):
        super().__init__(SmokeTestConfig(vocab_size=257, d_model=8))
        self.seen = []

    def forward(self, x, targets=None, document_ids=None):
        self.seen.append(document_ids)
        return super().forward(x, targets, document_ids)


def test_training_and_evaluation_hand_the_boundaries_to_a_model_that_takes_them(tmp_path, tiny_data_dir) -> None:
    data = TokenData(tiny_data_dir)
    first_train, first_val = (loader.next_batch() for loader in data.loaders(1, 64))  # val: 73 tokens
    assert first_train.document_ids is not None and first_val.document_ids is not None
    model = RecordsDocuments()
    trainer = make_trainer(tmp_path / "takes", data, model, batch_size=1, seq_len=64)
    trainer.train_step()
    assert len(model.seen) == 1 and torch.equal(model.seen[0], first_train.document_ids)
    model.seen.clear()
    trainer.run_eval()  # the val split masks as the train split does
    assert torch.equal(model.seen[0], first_val.document_ids)
    # A model whose forward has no document_ids keyword trains as before: each row one sequence.
    plain = make_trainer(tmp_path / "plain", data, WrapsSmoke(257), batch_size=1, seq_len=64)
    assert plain.train_step()["skipped"] is False


def test_evaluate_masks_as_the_run_trained(tiny_data_dir) -> None:
    class Loaded:
        data = {"_target_": "k3train.data.TokenData", "path": str(tiny_data_dir)}

    assert data_config(Loaded(), [])["document_masking"] is False  # trained before the setting existed: unmasked
    Loaded.data = {**Loaded.data, "document_masking": True}
    assert data_config(Loaded(), [])["document_masking"] is True
    overrides = ["data=prepared", f"data.path={tiny_data_dir}"]
    assert data_config(Loaded(), overrides)["document_masking"] is True
    assert data_config(Loaded(), [*overrides, "data.document_masking=false"])["document_masking"] is False
