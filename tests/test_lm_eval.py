"""The lm-evaluation-harness adapter (k3train/inference/lm_eval.py): its loglikelihoods are k3train's own
per-token losses; generation goes through k3train's sampler; a local YAML/JSONL task runs offline."""

import os

import pytest
import torch
from lm_eval.api.instance import Instance

from k3train.data.tokenizers import ByteTokenizer
from k3train.inference.lm_eval import K3TrainLM
from k3train.inference.sampling import Sampler, generate

from helpers.tiny_k3 import tiny_model

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.usefixtures("one_thread")


def request(kind, args, i=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=i)


@pytest.fixture(scope="module")
def lm():
    model = tiny_model(seed=3, vocab_size=ByteTokenizer.vocab_size, max_seq_len=64).eval()
    return K3TrainLM.from_model(model, ByteTokenizer(), batch_size=3)


@torch.no_grad()
def own_loss_sum(model, ids: list[int], n_continuation: int) -> float:
    """Minus k3train's own cross-entropy (the training forward's loss) of each of the last n tokens of ids, summed
    in fp64: one forward per token, every other target ignored (-100), so each loss is that token's alone."""
    x = torch.tensor([ids[:-1]])
    total = 0.0
    for position in range(len(ids) - 1 - n_continuation, len(ids) - 1):
        y = torch.full_like(x, -100)
        y[0, position] = ids[position + 1]
        total -= float(model(x, targets=y)[1])
    return total


PAIRS = [
    ("The cat sat on", " the mat"),
    ("Once upon a time, there was a", " little dog named Spot."),
    ("a", "b"),
    ("Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", " 21 22"),
]


def test_loglikelihood_equals_k3trains_own_per_token_losses(lm):
    got = lm.loglikelihood([request("loglikelihood", pair, i) for i, pair in enumerate(PAIRS)])
    tok = ByteTokenizer()
    for (context, continuation), (logprob, _) in zip(PAIRS, got):
        ids = [int(i) for i in tok.encode(context + continuation)]
        n = len(tok.encode(continuation))
        assert logprob == pytest.approx(own_loss_sum(lm.model, ids, n), abs=1e-6, rel=0)


def test_is_greedy_and_an_over_long_text_keeps_its_last_max_length_tokens(lm):
    text = "".join(chr(97 + i % 26) for i in range(100))  # longer than max_seq_len=64
    ((logprob, _),) = lm.loglikelihood([request("loglikelihood", (text[:-5], text[-5:]))])
    ids = [int(i) for i in ByteTokenizer().encode(text)][-65:]
    assert logprob == pytest.approx(own_loss_sum(lm.model, ids, 5), abs=1e-6, rel=0)
    # the greedy continuation of a context is greedy by definition
    prompt = torch.tensor([[int(i) for i in ByteTokenizer().encode("The cat")]])
    first = next(generate(lm.model, prompt, 1, Sampler(temperature=0)))
    context = prompt[0].tolist()
    (_, greedy), (_, other) = lm._loglikelihood_tokens(
        [(None, context, [int(first[0])]), (None, context, [(int(first[0]) + 1) % 256])]
    )
    assert greedy and not other


def test_loglikelihood_rolling_sums_the_whole_text(lm):
    text = "Hello there, general."
    (total,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", (text,))])
    ids = [ByteTokenizer.eod_id] + [int(i) for i in ByteTokenizer().encode(text)]
    assert total == pytest.approx(own_loss_sum(lm.model, ids, len(ids) - 1), abs=1e-5, rel=0)


def test_generate_until_is_k3trains_greedy_generation_cut_at_the_stop_string(lm):
    tok = ByteTokenizer()
    prompt = torch.tensor([[int(i) for i in tok.encode("The cat")]])
    reference = tok.decode(int(t[0]) for t in generate(lm.model, prompt, 12, Sampler(temperature=0)))
    (full,) = lm.generate_until([request("generate_until", ("The cat", {"until": [], "max_gen_toks": 12}))])
    assert full == reference.split(tok.eod_text)[0]
    stop = full[3:5]
    (cut,) = lm.generate_until([request("generate_until", ("The cat", {"until": [stop], "max_gen_toks": 12}))])
    assert cut == full.split(stop)[0]


@pytest.mark.slow
def test_a_local_multiple_choice_task_runs_offline_through_the_adapter(lm, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from helpers.local_task import TASK, write_local_task

    text = "the quick brown fox jumps over the lazy dog. " * 20
    # the local folder alone: indexing lm_eval's own tasks adds 10-30 s and nothing this test reads
    tasks = TaskManager(include_path=str(write_local_task(tmp_path / "tasks", text, n=6)), include_defaults=False)
    out = simple_evaluate(model=lm, tasks=[TASK], task_manager=tasks, bootstrap_iters=0, verbosity="ERROR")
    assert 0.0 <= out["results"][TASK]["acc,none"] <= 1.0
    assert out["n-samples"][TASK]["effective"] == 6


def test_a_continuation_longer_than_max_length_is_refused_naming_both(lm):
    with pytest.raises(ValueError, match="continuation of 70 tokens is longer than max_length=64"):
        lm.loglikelihood([request("loglikelihood", ("ctx", "x" * 70))])
