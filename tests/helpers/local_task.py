"""A small multiple-choice task in lm-eval's YAML + JSONL form, written by the test (no hub at run time):
the right answer of each question is the next piece of a text, the wrong ones that piece's bytes shuffled."""

import json
import random
from pathlib import Path

TASK = "k3_local_mc"


def write_local_task(directory: Path, text: str, n: int = 24, context: int = 48, answer: int = 24, seed: int = 0):
    """directory/<TASK>.yaml and its data file; returns the directory (lm_eval's include_path)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for _ in range(n):
        start = rng.randrange(0, len(text) - context - answer)
        ctx, right = text[start : start + context], text[start + context : start + context + answer]
        choices = [right]
        while len(choices) < 4:
            wrong = list(right)
            rng.shuffle(wrong)
            if "".join(wrong) not in choices:
                choices.append("".join(wrong))
        order = list(range(4))
        rng.shuffle(order)
        rows.append({"context": ctx, "choices": [choices[j] for j in order], "label": order.index(0)})
    data = directory / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        'target_delimiter: ""\n'
        "metric_list:\n"
        "  - metric: acc\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n"
    )
    return directory
