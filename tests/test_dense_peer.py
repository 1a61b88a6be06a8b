"""The dense peer (k3train/models/dense.py, conf/model/dense_peer.yaml): it learns, it is causal and keeps documents
apart, its FLOP and parameter counts are right, it matches k3_small's active parameters, it refuses bad settings,
and it trains and resumes exactly through `python -m k3train`."""

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from k3train.checkpoint.checkpointer import load_checkpoint
from k3train.inference.loading import MODEL_TARGETS, load
from k3train.models.dense import DenseConfig, DenseTransformer
from k3train.models.protocol import CountsFlops, missing_members
from k3train.observe.metrics import read_metrics

from helpers.config import model_config

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=64)


def tiny(seed: int = 0, **changes) -> DenseTransformer:
    torch.manual_seed(seed)
    return DenseTransformer.from_fields(**{**TINY, **changes})


def tokens(B: int, T: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def test_it_is_a_language_model_whose_loss_is_the_cross_entropy_of_its_logits():
    model = tiny()
    assert missing_members(model) == [] and isinstance(model, CountsFlops)
    x, y = tokens(2, 16, 0), tokens(2, 16, 1)
    logits, _ = model(x)
    _, loss = model(x, targets=y)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), y.flatten()))


def test_loss_decreases_on_a_fixed_batch():
    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = tokens(2, 16, 0), tokens(2, 16, 1)
    losses = []
    for _ in range(15):
        _, loss = model(x, targets=y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(TINY["vocab_size"]), rel=0.05)  # a fresh model is at chance
    assert losses[-1] < 0.5 * losses[0], losses  # random targets: only memorising the batch lowers it this far


def test_a_later_token_changes_no_earlier_position():
    model = tiny().eval()
    x = tokens(2, 16, 0)
    changed = x.clone()
    changed[:, 9] = (x[:, 9] + 1) % TINY["vocab_size"]
    with torch.no_grad():
        before, after = model(x)[0], model(changed)[0]
    torch.testing.assert_close(after[:, :9], before[:, :9], rtol=0, atol=1e-6)
    assert (after[:, 9:] - before[:, 9:]).abs().amax() > 1e-3  # the change does reach position 9 and after


def test_packed_documents_see_only_themselves():
    """With document_ids, each document's logits are those it gets alone (RoPE scores depend only on distance, so
    the second document's offset in the row does not matter); without, the second one reads the first."""
    model = tiny().eval()
    x = tokens(2, 16, 0)
    document_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 12 + [1] * 4])
    with torch.no_grad():
        packed = model(x, document_ids=document_ids)[0]
        unmasked = model(x)[0]
        for row, start in ((0, 5), (1, 12)):
            first, second = model(x[row : row + 1, :start])[0], model(x[row : row + 1, start:])[0]
            torch.testing.assert_close(packed[row : row + 1, :start], first, rtol=0, atol=1e-5)
            torch.testing.assert_close(packed[row : row + 1, start:], second, rtol=0, atol=1e-5)
            assert (unmasked[row : row + 1, start:] - second).abs().amax() > 1e-3


def test_flops_per_token_match_a_hand_count():
    # TINY at seq_len 16, multiply-adds per token: per layer q, k, v, o 4 * 32 * 32 = 4096; attention
    # 16 keys * 4 heads * (8 for q.k + 8 for p.v) = 1024; SwiGLU 3 * 32 * 48 = 4608; two layers 19456;
    # the LM head 32 * 40 = 1280: 20736 multiply-adds, 41472 FLOPs forward, three times that training.
    assert tiny().flops_per_token(16) == {"forward": 41472.0, "training": 124416.0}


def test_flops_per_token_match_torch_flop_counter():
    """torch's own count of every matmul and of attention (the math backend: the counter has no formula for
    torch's fused CPU kernel), forward alone and forward + backward. In training the counter misses one matmul:
    the LM head's weight gradient, which linear_cross_entropy accumulates with an in-place addmm_ (checked here
    to be invisible to it), 2 d V FLOPs per token."""
    with FlopCounterMode(display=False) as counter:
        torch.zeros(4, 6).addmm_(torch.randn(4, 8), torch.randn(8, 6), beta=0)
    assert counter.get_total_flops() == 0
    model = tiny()
    B, T = 2, 16
    x, y = tokens(B, T, 0), tokens(B, T, 1)
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH):
        with counter, torch.no_grad():
            model(x)
        forward = counter.get_total_flops() / (B * T)
        with counter:
            model(x, targets=y)[1].backward()
        training = counter.get_total_flops() / (B * T) + 2 * TINY["d_model"] * TINY["vocab_size"]
    assert model.flops_per_token(T) == {"forward": forward, "training": training}


def test_param_counts_by_hand():
    # embedding 40 * 32 = 1280; per layer q, k, v, o 4 * 32 * 32 + SwiGLU 3 * 32 * 48 + two norms 2 * 32 = 8768;
    # the final norm 32: 1280 + 2 * 8768 + 32 = 18848 with the head tied, 1280 more untied. A dense model: a token
    # uses every parameter.
    assert tiny().param_counts() == {"total": 18848, "active": 18848, "embedding": 1280}
    assert tiny(tie_embeddings=False).param_counts() == {"total": 20128, "active": 20128, "embedding": 1280}


def test_dense_peer_has_k3_small_active_parameters():
    """conf/model/dense_peer.yaml's claim: within 5% of k3_small's active parameters, with and without the
    embedding, at the GPU benchmark's vocabulary (built on the meta device: no memory, no initialisation cost)."""
    with torch.device("meta"):
        k3 = instantiate(model_config("k3_small"), vocab_size=32768).param_counts()
        dense = instantiate(model_config("dense_peer"), vocab_size=32768).param_counts()
    for counts in (k3, dense):
        counts["active_without_embedding"] = counts["active"] - counts["embedding"]
    for key in ("active", "active_without_embedding"):
        assert dense[key] == pytest.approx(k3[key], rel=0.05), (key, dense[key], k3[key])


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(d_model=30), "d_model=30 must be a multiple of n_heads=4"),
        (dict(d_model=12), "head_dim = d_model / n_heads = 3 must be even"),
        (dict(ffn_dim=0), "ffn_dim=0 must be a positive integer"),
        (dict(vocab_size=-1), "vocab_size=-1 must be a positive integer"),
        (dict(norm_eps=0.0), "norm_eps=0.0 must be > 0"),
        (dict(model_type="kimi_k3"), "DenseConfig only builds 'dense_transformer'"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DenseConfig(**{**TINY, **changes})


def test_data_it_cannot_train_on_is_refused():
    model = tiny()
    with pytest.raises(ValueError, match="vocab_size is 257 but the model's is 40"):
        model.check_data(257, 16)
    with pytest.raises(ValueError, match="seq_len=65 exceeds the model's max_seq_len=64"):
        model.check_data(40, 65)
    with pytest.raises(ValueError, match="needs config.vocab_size"):
        DenseTransformer(DenseConfig(**{**TINY, "vocab_size": None}))


# A tiny dense_peer on the built-in corpus (document masking on: the batches carry boundaries), Muon + AdamW.
DENSE_RUN = [
    "model=dense_peer",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.ffn_dim=64",
    "train.batch_size=2",
    "train.seq_len=32",
    "train.max_steps=4",
    "train.log_interval=1",
    "train.eval_interval=2",
    "train.eval_batches=2",
    "train.checkpoint_interval=0",
    "train.progress=lines",
    "train.deterministic=true",
    "train.cpu_threads=1",
    "schedule.warmup_steps=0",
]


@pytest.mark.slow
def test_trains_through_the_cli_and_resumes_exactly(run_cli, tmp_path):
    """4 updates straight == 2, exit, resume=auto in a new process, 2 more: the same losses and weights, bitwise."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    proc = run_cli(*DENSE_RUN, f"hydra.run.dir={straight}")
    assert proc.returncode == 0, proc.stderr
    sliced = [*DENSE_RUN, "resume=auto", "train.stop_after=2", f"hydra.run.dir={split}"]
    first = run_cli(*sliced)
    assert first.returncode == 0, first.stderr
    second = run_cli(*sliced)
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout

    def events(run_dir, kind):
        return [e for e in read_metrics(run_dir / "metrics.jsonl") if e["event"] == kind]

    losses = {e["step"]: e["loss"] for e in events(straight, "train")}
    assert list(losses) == [1, 2, 3, 4] and all(math.isfinite(loss) for loss in losses.values())
    assert {e["step"]: e["loss"] for e in events(split, "train")} == losses
    assert [e["loss"] for e in events(split, "eval")] == [e["loss"] for e in events(straight, "eval")]
    a, b = load_checkpoint(straight / "last.pt"), load_checkpoint(split / "last.pt")
    assert a["trainer"]["step"] == b["trainer"]["step"] == 4
    for name, value in a["model"].items():
        assert torch.equal(b["model"][name], value), name
    # the Trainer's MFU comes from the model's own count
    assert all(0 < e["mfu"] < 1 for e in events(straight, "train"))
    flops = json.loads((straight / "run.json").read_text())["flops"]["flops_per_token"]
    fields = dict(TINY, d_model=32, n_layers=2, n_heads=4, ffn_dim=64, vocab_size=257, max_seq_len=4096)
    assert flops == DenseTransformer.from_fields(**fields).flops_per_token(32)
    # generate and evaluate find the class by model_type when the run directory has lost its .hydra/
    shutil.rmtree(straight / ".hydra")
    loaded = load(straight)
    assert isinstance(loaded.model, DenseTransformer) and loaded.model_target == MODEL_TARGETS["dense_transformer"]
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, a["model"][name]), name
