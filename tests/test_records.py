"""Typed records at every process boundary (raychat.records): each round-trips through its dict (and
JSON where it is written to storage), an unknown or a missing field is refused in one line naming
the record and the field, and the meta.json of raychat's previous versions still loads."""

import json
import pickle

import pytest

from raychat.checkpoint.meta import META_VERSION, CheckpointMeta, LoopState, Totals
from raychat.checkpoint.stop_note import StopNote, read_stop_note, write_stop_note
from raychat.config import TrainConfig
from raychat.corpus.index import CorpusRecord
from raychat.data.cursor import Cursor, RankCursor
from raychat.elastic.coordinator import Attempt, FinalResult
from raychat.model.gpt import GPTConfig
from raychat.records import Record, RecordError
from raychat.scaling import resolve_plan

FLAGS = TrainConfig(depth=2, max_seq_len=32, device_batch_size=4, total_batch_size=256, num_iterations=8,
                    model_tag="tiny", storage_path="s3://bucket/runs?access_key=AKIA&secret_key=SECRET")
PLAN = resolve_plan(FLAGS, vocab_size=512, world_size=2)
CURSOR = Cursor(world_size=2, frontier=7, epoch=1, in_flight=[[1, 0, 3, 5]], unstarted=[4, 6], num_units=10,
                shuffle_seed=None, ranks=[RankCursor(0, 2, 4, [[1, 0, 3, 5]]), RankCursor(1, 2, 7, [])])
CORPUS = CorpusRecord(location="/data/corpus", source="hub", repo="karpathy/climbmix", revision="abc123",
                      identity={"shard_00000.parquet": [1234, "f00d"]})
META = CheckpointMeta(step=8, model_config=PLAN.model, world_size=2, vocab_size=512,
                      tokenizer_fingerprint="tok", session="s1", sequence=3, parent="checkpoint_000004",
                      lease_epoch=2, raychat_version="0.1", plan=PLAN, user_config=FLAGS, corpus=CORPUS,
                      cursor=CURSOR,
                      loop_state=LoopState(step=8, min_val_bpb=1.5, val_bpb=1.5, restarts=1),
                      val_bpb=1.5, metrics=Totals(tokens_so_far=2048, flops_so_far=4096))
ATTEMPT = Attempt(attempt=1, last_step=29, world_size=3, planned_step=None, notice_step=25,
                  last_progress=10.5, noticed=11.0)
RESULT = FinalResult(step=8, tokens_so_far=2048, min_val_bpb=1.5, total_training_time=3.0, core_metric=0.1,
                     restarts=1, peak_memory_mib=100.0)
STOP = StopNote(reason="error", session="s1", message="--data-dir: no corpus")
# One of every record, and a field each must have (None: every field has a default).
EXAMPLES = [(META, "step"), (PLAN, "num_iterations"), (PLAN.model, None), (FLAGS, None),
            (CORPUS, "location"), (CURSOR, "frontier"), (CURSOR.ranks[0], "next_position"),
            (META.loop_state, None), (META.metrics, "flops_so_far"), (ATTEMPT, "last_step"),
            (RESULT, "min_val_bpb"), (STOP, "session")]
IDS = [type(record).__name__ for record, _ in EXAMPLES]


@pytest.mark.unit
@pytest.mark.parametrize(("record", "required"), EXAMPLES, ids=IDS)
def test_each_record_round_trips_through_json(record, required):
    data = json.loads(json.dumps(record.to_dict()))
    assert data[record.VERSION_KEY] == record.VERSION
    assert type(record).from_dict(data) == record


@pytest.mark.unit
@pytest.mark.parametrize(("record", "required"), EXAMPLES, ids=IDS)
def test_an_unknown_field_is_refused_in_one_line_naming_record_and_field(record, required):
    data = {**record.to_dict(), "stpe": 8}
    with pytest.raises(RecordError) as err:
        type(record).from_dict(data, where="somewhere.json")
    message = str(err.value)
    assert message.startswith(f"somewhere.json: {type(record).__name__} has an unknown field 'stpe'")
    assert "\n" not in message


@pytest.mark.unit
@pytest.mark.parametrize(("record", "required"), [e for e in EXAMPLES if e[1]],
                         ids=[i for i, e in zip(IDS, EXAMPLES, strict=True) if e[1]])
def test_a_missing_field_is_refused_in_one_line_naming_record_and_field(record, required):
    data = record.to_dict()
    del data[required]
    with pytest.raises(RecordError) as err:
        type(record).from_dict(data)
    assert str(err.value) == f"{type(record).__name__} lacks the field {required!r}"


@pytest.mark.unit
def test_a_nested_record_names_its_path_and_the_file():
    data = META.to_dict()
    data["cursor"]["ranks"][1]["pendng"] = []
    with pytest.raises(RecordError) as err:
        CheckpointMeta.from_json(json.dumps(data), where="run/checkpoint_000008/meta.json")
    assert str(err.value).startswith("run/checkpoint_000008/meta.json: CheckpointMeta.cursor.ranks[1]: "
                                     "RankCursor has an unknown field 'pendng'")


@pytest.mark.unit
def test_a_newer_version_is_refused_and_credentials_never_reach_the_json():
    data = {**RESULT.to_dict(), "version": FinalResult.VERSION + 1}
    with pytest.raises(RecordError, match="FinalResult has version 2, this raychat reads versions 1 to 1"):
        FinalResult.from_dict(data)
    text = META.to_json().decode()
    assert "SECRET" not in text and "AKIA" not in text
    # Pickled (as Ray Train hands the workers their config) the location keeps what opens the bucket.
    assert "SECRET" in pickle.loads(pickle.dumps(FLAGS.to_dict()))["storage_path"].unredacted()


# A plain field given a value of another kind: (record, field, value, expected, got) as the error says.
WRONG_KINDS = [
    (META, "step", "8", "int", "str"),
    (META, "step", True, "int", "bool"),  # bool is an int to Python, not to a record
    (META, "world_size", 2.0, "int", "float"),
    (META, "parent", 4, "str or None", "int"),
    (META, "model_config", None, "GPTConfig", "None"),  # None only where the annotation allows it
    (FLAGS, "fp8", 1, "bool", "int"),
    (FLAGS, "run", None, "str", "None"),
    (PLAN, "params", [1, 2], "dict", "list"),
    (CORPUS, "identity", [], "dict or None", "list"),
    (CURSOR, "unstarted", {"4": 6}, "list", "dict"),
    (META.loop_state, "min_val_bpb", True, "float", "bool"),
    (META.loop_state, "val_bpb", "1.5", "float or None", "str"),
    (ATTEMPT, "last_progress", [10.5], "float or None", "list"),
    (RESULT, "min_val_bpb", [1.5], "float", "list"),
    (STOP, "session", 7, "str", "int"),
]


@pytest.mark.unit
@pytest.mark.parametrize(("record", "key", "value", "expected", "got"), WRONG_KINDS,
                         ids=[f"{type(r).__name__}.{k}={v!r}" for r, k, v, _, _ in WRONG_KINDS])
def test_a_plain_field_of_the_wrong_kind_is_refused_in_one_line(record, key, value, expected, got):
    data = json.loads(json.dumps({**record.to_dict(), key: value}))
    with pytest.raises(RecordError) as err:
        type(record).from_dict(data, where="somewhere.json")
    assert str(err.value) == (f"somewhere.json: {type(record).__name__} has the field {key!r} of the wrong "
                              f"kind: expected {expected}, got {got}")


@pytest.mark.unit
def test_what_a_field_may_hold_besides_its_exact_type_still_loads():
    """An int where a float is declared (a whole number as another tool writes it), None where the
    annotation allows it, a tuple where a list is (a pickled dict keeps tuples)."""
    loaded = FinalResult.from_dict({**RESULT.to_dict(), "min_val_bpb": 2, "core_metric": None})
    assert loaded.min_val_bpb == 2 and loaded.core_metric is None
    assert Cursor.from_dict({**CURSOR.to_dict(), "unstarted": (4, 6)}) == CURSOR
    assert FLAGS.from_dict({**FLAGS.to_dict(), "gpus_per_worker": 1}).gpus_per_worker == 1


@pytest.mark.unit
def test_a_nested_records_wrong_kind_names_its_path():
    data = META.to_dict()
    data["cursor"]["ranks"][1]["next_position"] = "7"
    with pytest.raises(RecordError) as err:
        CheckpointMeta.from_json(json.dumps(data), where="run/checkpoint_000008/meta.json")
    assert str(err.value) == ("run/checkpoint_000008/meta.json: CheckpointMeta.cursor.ranks[1]: RankCursor "
                              "has the field 'next_position' of the wrong kind: expected int, got str")


@pytest.mark.unit
def test_the_stop_note_round_trips_through_storage(tmp_path):
    write_stop_note(str(tmp_path), "run", STOP)
    assert read_stop_note(str(tmp_path), "run") == STOP
    note = tmp_path / "run" / "raychat_stopped.json"
    note.write_text(json.dumps({"reason": "nan", "step": 3, "version": 1}))
    with pytest.raises(RecordError, match=r"raychat_stopped.json: StopNote lacks the field 'session'"):
        read_stop_note(str(tmp_path), "run")


@pytest.mark.ray
def test_the_workers_config_reaches_them_typed(ray_session):
    import ray

    from raychat.worker.components import WorkerRunConfig

    config = WorkerRunConfig(train_config=FLAGS, plan=PLAN, corpus_index=ray.put([1, 2]),
                             tokenizer_fingerprint="tok", session="s1", lease_epoch=2, launched=1.0,
                             resume_from=None, init_weights=None, compile_checked=False)
    # What Ray Train does with train_loop_config: pickle it to every worker.
    shipped = pickle.loads(pickle.dumps(config.to_dict()))
    received = WorkerRunConfig.from_dict(shipped, where="train_loop_config")
    assert received == config and ray.get(received.corpus_index) == [1, 2]
    assert received.train_config.storage_path.unredacted() == FLAGS.storage_path.unredacted()


def v2_meta() -> dict:
    """meta.json as raychat wrote it at format version 2: every part a plain dict, the plan with its
    total FLOPs, the flags with one this raychat no longer has, the cursor's ranks without a version."""
    plan = {key: value for key, value in PLAN.to_json().items() if key != "version"}  # with total_flops
    model = {key: value for key, value in PLAN.model.to_dict().items() if key != "version"}
    return {
        "step": 8, "model_config": model,
        "world_size": 2, "vocab_size": 512, "tokenizer_fingerprint": "tok", "session": "s1", "sequence": 3,
        "parent": "checkpoint_000004", "lease_epoch": 2, "raychat_version": "0.0.9",
        "plan": {**plan, "model": model},
        "user_config": {**FLAGS.to_public_dict(), "a_flag_since_removed": 1},
        "corpus": {"source": "hub", "repo": "karpathy/climbmix", "revision": "abc123",
                   "location": "/data/corpus", "identity": {"shard_00000.parquet": [1234, "f00d"]}},
        "cursor": {"version": 1, "world_size": 2, "frontier": 7, "epoch": 1, "in_flight": [[1, 0, 3, 5]],
                   "unstarted": [4, 6], "num_units": 10, "shuffle_seed": None,
                   "ranks": [{"rank": 0, "world_size": 2, "next_position": 4, "pending": [[1, 0, 3, 5]]},
                             {"rank": 1, "world_size": 2, "next_position": 7, "pending": []}]},
        "loop_state": {"step": 8, "min_val_bpb": 1.5, "smooth_train_loss": 0.0, "total_training_time": 0.0,
                       "val_bpb": 1.5, "core_metric": None, "restarts": 1, "resizes": 0, "redone_steps": 0},
        "val_bpb": 1.5, "metrics": {"tokens_so_far": 2048, "flops_so_far": 4096},
        "format_version": 2,
    }


@pytest.mark.unit
def test_the_previous_versions_meta_json_still_loads():
    meta = CheckpointMeta.from_json(json.dumps(v2_meta()))
    assert meta.model_config == PLAN.model and meta.plan == PLAN
    assert meta.user_config.model_tag == "tiny" and meta.user_config.storage_path == FLAGS.storage_path
    assert meta.corpus == CORPUS and meta.cursor == CURSOR
    assert meta.loop_state == META.loop_state and meta.metrics == META.metrics
    # Written again, it is a version-3 record that reads back the same.
    assert json.loads(meta.to_json())["format_version"] == META_VERSION == 4
    assert CheckpointMeta.from_json(meta.to_json()) == meta
    # Version 2's empty parts (a bench's or a test's checkpoint) are unknown parts now.
    bare = CheckpointMeta.from_json(json.dumps({"step": 1, "model_config": {}, "plan": {}, "user_config": {},
                                                "corpus": {}, "loop_state": {}, "metrics": {},
                                                "format_version": 2}))
    assert (bare.plan, bare.user_config, bare.corpus, bare.metrics) == (None, None, None, None)
    assert bare.model_config == GPTConfig() and bare.loop_state == LoopState()
    # Version 1: no version, no lineage.
    old = CheckpointMeta.from_json(json.dumps({"step": 5, "model_config": {}, "world_size": 2}))
    assert (old.step, old.world_size, old.sequence, old.parent) == (5, 2, 0, None)


@pytest.mark.unit
def test_a_first_release_meta_json_loads_with_what_it_lacks_unknown_and_a_bad_value_is_one_line():
    """The first release's plan had no precision: the checkpoint stays readable (its plan unknown),
    rather than being skipped and the run started over. A value of the wrong kind, or a stored flag
    the config refuses, is the file's fault: one line naming it."""
    first = v2_meta()
    del first["plan"]["precision"], first["format_version"]
    meta = CheckpointMeta.from_json(json.dumps(first), where="ckpt/meta.json")
    assert meta.plan is None and meta.cursor == CURSOR and meta.corpus == CORPUS and meta.step == 8
    for part, bad in (("user_config", {"depth": "x"}), ("user_config", {"warmdown_ratio": 1.5})):
        edited = v2_meta()
        edited[part] = {**edited[part], **bad}
        with pytest.raises(RecordError) as err:
            CheckpointMeta.from_json(json.dumps(edited), where="ckpt/meta.json")
        assert str(err.value).startswith("ckpt/meta.json") and "\n" not in str(err.value)


@pytest.mark.unit
def test_every_record_is_a_record():
    """Every process boundary's type mixes in Record: no untyped dict is left in a checkpoint's meta."""
    assert all(isinstance(record, Record) for record, _ in EXAMPLES)
    hints = {name: str(hint) for name, hint in CheckpointMeta.__annotations__.items()}
    assert not [name for name, hint in hints.items() if "dict" in hint]
