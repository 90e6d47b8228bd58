"""CORE as nanochat scores it: prompts rendered exactly, scores of a hand-analysable model worked out by
hand for every task type, the same at any world size, the deterministic subsample, bad bundles."""

import random

import pytest
import torch
from core_bundle import ChainModel, byte_tokenizer, write_bundle

from raychat.common import RaychatError
from raychat.evaluation.bundle import load_bundle
from raychat.evaluation.core import combine, render_prompts, score_shard, task_examples

pytestmark = pytest.mark.unit

# Hand-worked with ChainModel ("abcde fghij": each byte predicts the next; a hit = the target follows).
MC = [  # delimiter " ": the scored span starts after the choices' common token prefix
    {"query": "abcde", "choices": ["fgh", "fxy", "zzz"], "gold": 0},  # hits 3/3, 1/3, 0/3 -> 0 right
    {"query": "q", "choices": ["fgx", "fgh"], "gold": 0},  # span = last byte: x miss, h hit -> 1 wrong
    {"query": "z", "choices": ["ab", "fg"], "gold": 1},  # 1/2 against 2/2 -> 1 right
    {"query": "z", "choices": ["fq", "fr"], "gold": 1},  # span q | r, both miss: tie -> first -> wrong
    # 1/1 against 4/6 -> right (over whole prompts the longer choice would win: 1/10 against 4/15)
    {"query": "zzzzzzzz", "choices": ["f", "yfghij"], "gold": 0},
]
SCHEMA = [  # the scored span is the options' common token suffix
    {"context_options": ["abcde", "xyz"], "continuation": "fgh", "gold": 0},  # " fgh": 4/4, 3/4 -> right
    {"context_options": ["xye", "abcd"], "continuation": "fg", "gold": 1},  # " fg": 3/3, 2/3 -> wrong
    # the common suffix reaches into the options: "e fg", 3/4 against 4/4 -> right (" fg" alone: a tie)
    {"context_options": ["xe", "abcde"], "continuation": "fg", "gold": 1},
]
LM = [  # right when every continuation token (with the delimiter's space) is the greedy prediction
    {"context": "abcde  ", "continuation": "fgh"},  # context trimmed: e->' '->f->g->h: right
    {"context": "abc", "continuation": "de"},  # c->' ' is a miss: wrong
    {"context": "xyzabcde", "continuation": "fghij"},  # right
]
TASKS = [
    {"label": "mc", "type": "multiple_choice", "shots": 0, "baseline": 25, "data": MC},
    {"label": "schema", "type": "schema", "shots": 0, "baseline": 50, "data": SCHEMA},
    {"label": "lm", "type": "language_modeling", "shots": 1, "baseline": 0, "data": LM},
]


def score(bundle, world_size: int, max_per_task: int = -1):
    tokenizer = byte_tokenizer()
    model = ChainModel(tokenizer.vocab_size)
    shards = [score_shard(model, tokenizer, bundle, max_per_task, rank, world_size, torch.device("cpu"))
              for rank in range(world_size)]
    return combine(bundle, max_per_task, shards)


def test_scores_worked_out_by_hand_and_the_same_at_any_world_size(tmp_path):
    bundle = load_bundle(write_bundle(tmp_path, TASKS))
    result = score(bundle, 1)

    def mean(*right: int) -> float:  # nanochat's float32 mean
        return torch.tensor(right, dtype=torch.float32).mean().item()

    assert result.accuracy == {"mc": mean(1, 0, 1, 0, 1), "schema": mean(1, 0, 1), "lm": mean(1, 0, 1)}
    assert result.centered["mc"] == pytest.approx((0.6 - 0.25) / 0.75)
    assert result.centered["schema"] == pytest.approx((2 / 3 - 0.5) / 0.5)
    assert result.centered["lm"] == result.accuracy["lm"]
    assert result.core_metric == pytest.approx((0.35 / 0.75 + 1 / 3 + 2 / 3) / 3, abs=1e-6)
    assert result.num_examples == 11
    for world_size in (2, 3, 4):
        assert score(bundle, world_size) == result


def test_prompts_are_rendered_as_nanochat_renders_them():
    shots = [{"query": "Q1", "choices": ["a", "b"], "gold": 1}, {"query": "Q2", "choices": ["c"], "gold": 0}]
    assert render_prompts("multiple_choice", {"query": "Q3", "choices": ["x", "y"]}, ": ", shots) == [
        "Q1: b\n\nQ2: c\n\nQ3: x", "Q1: b\n\nQ2: c\n\nQ3: y"]
    shots = [{"context_options": ["A", "B"], "continuation": "k", "gold": 0}]
    assert render_prompts("schema", {"context_options": ["C", "D"], "continuation": "m"}, " ", shots) == [
        "A k\n\nC m", "A k\n\nD m"]
    shots = [{"context": " one \n", "continuation": "two"}]
    item = {"context": "three  ", "continuation": " four"}
    assert render_prompts("language_modeling", item, " ", shots) == [
        "one two\n\nthree", "one two\n\nthree  four"]
    assert render_prompts("language_modeling", item, "\n", []) == ["three", "three\n four"]


def test_max_per_task_scores_a_fixed_subsample(tmp_path):
    items = [{"context": "abcde", "continuation": "fgh"}] * 3 + [{"context": "abc", "continuation": "zz"}] * 7
    items = [dict(item, id=i) for i, item in enumerate(items)]
    task = {"label": "lm", "type": "language_modeling", "shots": 2, "baseline": 0, "data": items}
    bundle = load_bundle(write_bundle(tmp_path, [task]))
    order = list(range(10))
    random.Random(1337).shuffle(order)  # nanochat shuffles the task's examples with this seed
    chosen = task_examples(bundle.tasks[0], 4)
    assert [item["id"] for item in chosen] == order[:4]
    assert task_examples(bundle.tasks[0], 4) == chosen
    expected = torch.tensor([float(i < 3) for i in order[:4]]).mean().item()
    assert score(bundle, 1, max_per_task=4).accuracy["lm"] == expected
    assert score(bundle, 3, max_per_task=4).accuracy["lm"] == expected
    with pytest.raises(RaychatError, match="2-shot but only 2 examples.*--core-metric-max-per-task"):
        task_examples(bundle.tasks[0], 2)


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "core.yaml").unlink(), "no eval bundle at .*download-eval-bundle"),
    (lambda d: (d / "core.yaml").write_text("icl_tasks: [\n"),
     r"core.yaml is malformed \((Scanner|Parser)Error"),
    (lambda d: (d / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nmc,25\n"),
     "eval_meta_data.csv is malformed .no `Random baseline` for task schema"),
    (lambda d: (d / "eval_data" / "lm.jsonl").write_text('{"context": "a"}\n'),
     "lm.jsonl is malformed .line 1: field `continuation` missing"),
    (lambda d: (d / "eval_data" / "mc.jsonl").write_text('{"query": "q", "choices": ["a"], "gold": 1}\n'),
     "mc.jsonl is malformed .line 1: gold 1 is not an index"),
    (lambda d: (d / "eval_data" / "schema.jsonl").write_text("not json\n"),
     "schema.jsonl is malformed .line 1"),
    (lambda d: (d / "core.yaml").write_text((d / "core.yaml").read_text().replace("schema\n", "cloze\n")),
     "icl_task_type 'cloze' is not one of"),
    (lambda d: (d / "eval_data" / "lm.jsonl").unlink(), "its dataset .*lm.jsonl does not exist"),
])
def test_a_malformed_bundle_is_refused_in_one_line(tmp_path, damage, message):
    directory = write_bundle(tmp_path, TASKS)
    damage(directory)
    with pytest.raises(RaychatError, match=message) as error:
        load_bundle(directory)
    assert "\n" not in str(error.value)
