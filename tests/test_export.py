"""`python -m raychat.export --to nanochat`: the files nanochat's checkpoint_manager loads, with its names,
shapes and dtypes; loaded back into a GPT built from the exported meta, the same logits; the tokenizer
pickle encodes as raychat's tokenizer does."""

import dataclasses
import json
import pickle

import pytest
import torch

from raychat.checkpoint.format import checkpoint_dir_name
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.nanochat import MODEL_CONFIG_KEYS, load_nanochat_checkpoint, nanochat_keys
from raychat.checkpoint.sharded import save_checkpoint
from raychat.common import RaychatError
from raychat.config import TrainConfig
from raychat.export import main
from raychat.model.gpt import GPTConfig, build_model
from raychat.scaling import resolve_plan
from raychat.storage import Storage
from raychat.tokenizer.core import Tokenizer

STEP = 7
TEXTS = ["The capital of France is Paris.", "def f(x):\n    return x ** 2  # 12345", "ünïcödé and 東京"]


def trained_looking_model(config: GPTConfig, seed: int) -> torch.nn.Module:
    """A GPT with noise on every tensor: no zero projections, so every tensor shows in the logits."""
    torch.manual_seed(seed)
    model = build_model(config, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


@pytest.fixture
def run(tiny_corpus, tmp_path):
    """A checkpoint of a d3 model (value embeddings on layers 0 and 2) with trained-looking weights."""
    tokenizer = Tokenizer.load(tiny_corpus[1])
    config = GPTConfig(sequence_len=32, vocab_size=tokenizer.vocab_size, n_layer=3, n_head=2, n_kv_head=1,
                       n_embd=64, window_pattern="SL")
    model = trained_looking_model(config, seed=0)
    flags = TrainConfig(model_tag="tiny", depth=3, max_seq_len=32, device_batch_size=4, total_batch_size=1024,
                        num_iterations=10, embedding_lr=0.3)
    meta = CheckpointMeta(step=STEP, model_config=config, vocab_size=tokenizer.vocab_size,
                          tokenizer_fingerprint=tokenizer.fingerprint, val_bpb=2.5,
                          plan=resolve_plan(flags, tokenizer.vocab_size, world_size=1), user_config=flags)
    storage = tmp_path / "runs"
    directory = Storage(str(storage)).child("r", checkpoint_dir_name(STEP))
    save_checkpoint(directory, model.state_dict(), None, meta.to_json())
    return storage, tokenizer, config, model.state_dict()


def export(storage, tokenizer, out, *extra: str) -> None:
    assert main(["--run-name", "r", "--storage-path", str(storage), "--tokenizer-dir",
                 str(tokenizer.directory), "--to", "nanochat", "--out", str(out), *extra]) == 0


def logits(config: GPTConfig, state: dict, dtype: torch.dtype) -> torch.Tensor:
    model = build_model(GPTConfig(**config) if isinstance(config, dict) else config, "cpu")
    model.init_weights(dtype)  # the compute dtype
    model.load_state_dict(state, strict=True)
    idx = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.eval()(idx)


@pytest.mark.unit
@pytest.mark.parametrize("embedding_dtype", ["bf16", "fp32"])
def test_export_writes_nanochats_layout_and_loads_back_identically(run, tmp_path, embedding_dtype):
    storage, tokenizer, config, state = run
    out = tmp_path / "nanochat"
    export(storage, tokenizer, out, "--embedding-dtype", embedding_dtype)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["base_checkpoints/tiny/meta_000007.json", "base_checkpoints/tiny/model_000007.pt",
                     "tokenizer/token_bytes.pt", "tokenizer/tokenizer.pkl"]
    exported = torch.load(out / "base_checkpoints/tiny/model_000007.pt", weights_only=True)
    assert set(exported) == nanochat_keys(config) == set(state)
    assert "value_embeds.0.weight" in exported and "transformer.h.1.attn.ve_gate.weight" not in exported
    embedding = torch.bfloat16 if embedding_dtype == "bf16" else torch.float32
    for name, tensor in exported.items():
        is_embedding = name == "transformer.wte.weight" or name.startswith("value_embeds.")
        assert tensor.dtype == (embedding if is_embedding else torch.float32), name
        assert tensor.shape == state[name].shape, name
    meta = json.loads((out / "base_checkpoints/tiny/meta_000007.json").read_text())
    assert tuple(meta["model_config"]) == MODEL_CONFIG_KEYS
    assert meta["model_config"] == {key: getattr(config, key) for key in MODEL_CONFIG_KEYS}
    sizes = (meta["step"], meta["max_seq_len"], meta["device_batch_size"], meta["total_batch_size"])
    assert sizes == (7, 32, 4, 1024)
    assert meta["user_config"]["embedding_lr"] == 0.3  # nanochat's chat_sft inherits it
    # Built from the exported meta alone, the model computes exactly what the original computes: bitwise
    # in fp32 from an fp32 export; in bf16 (where nanochat computes) from the bf16 one.
    compute = torch.bfloat16 if embedding_dtype == "bf16" else torch.float32
    assert torch.equal(logits(meta["model_config"], exported, compute), logits(config, state, compute))
    if embedding_dtype == "fp32":
        assert all(torch.equal(exported[name], state[name]) for name in state)


@pytest.mark.unit
def test_the_tokenizer_files_encode_as_raychats_tokenizer(run, tmp_path):
    storage, tokenizer, _, _ = run
    export(storage, tokenizer, tmp_path / "nanochat")
    with open(tmp_path / "nanochat/tokenizer/tokenizer.pkl", "rb") as f:
        encoding = pickle.load(f)  # our own file, as nanochat's RustBPETokenizer.from_directory reads it
    assert encoding.n_vocab == tokenizer.vocab_size
    assert encoding.encode_single_token("<|bos|>") == tokenizer.bos_id
    for text in TEXTS:
        assert encoding.encode_ordinary(text) == tokenizer.encode(text)
    token_bytes = torch.load(tmp_path / "nanochat/tokenizer/token_bytes.pt", weights_only=True)
    assert token_bytes.dtype == torch.int32 and torch.equal(token_bytes, tokenizer.token_bytes())
    with pytest.raises(RaychatError, match="model_000007.pt exists"):
        export(storage, tokenizer, tmp_path / "nanochat")


@pytest.mark.unit
def test_a_nanochat_checkpoint_loads_back_bitwise_and_a_mismatch_is_one_line(run, tmp_path):
    """raychat -> nanochat's layout -> raychat: the same tensors, read without unpickling code."""
    storage, tokenizer, config, state = run
    out = tmp_path / "nanochat"
    export(storage, tokenizer, out, "--embedding-dtype", "fp32")
    directory = out / "base_checkpoints" / "tiny"
    seed = load_nanochat_checkpoint(directory, -1, config, tokenizer)
    assert seed.step == STEP and seed.config == config and seed.tokenizer_checked
    assert seed.state.keys() == state.keys() and all(torch.equal(seed.state[n], state[n]) for n in state)
    assert torch.equal(logits(seed.config, seed.state, torch.float32), logits(config, state, torch.float32))

    with pytest.raises(RaychatError, match=r"holds another model than these flags build \(n_layer 3 \(fl"):
        load_nanochat_checkpoint(directory, -1, dataclasses.replace(config, n_layer=2), tokenizer)
    with pytest.raises(RaychatError, match="--init-from-nanochat-step 5: .* has steps 7"):
        load_nanochat_checkpoint(directory, 5, config, tokenizer)
    with pytest.raises(RaychatError, match="no model_<step>.pt there"):
        load_nanochat_checkpoint(out, -1, config, tokenizer)
    # Another vocabulary's token_bytes.pt beside it: not the tokenizer nanochat trained the model with.
    token_bytes = out / "tokenizer" / "token_bytes.pt"
    torch.save(torch.flip(tokenizer.token_bytes(), [0]).clone(), token_bytes)
    with pytest.raises(RaychatError, match=r"is not the tokenizer of the nanochat model .*bytes.pt differs"):
        load_nanochat_checkpoint(directory, -1, config, tokenizer)
    token_bytes.unlink()
    assert not load_nanochat_checkpoint(directory, -1, config, tokenizer).tokenizer_checked
    # A model file that needs code to load is refused, never run.
    torch.save({"transformer.wte.weight": RanOnLoad()}, directory / "model_000007.pt")
    with pytest.raises(RaychatError, match="cannot be read as tensors only .* raychat loads no pickled code"):
        load_nanochat_checkpoint(directory, -1, config, tokenizer)
    assert not RanOnLoad.ran


class RanOnLoad:
    ran = False

    def __reduce__(self):
        return (RanOnLoad.mark, ())

    @staticmethod
    def mark():
        RanOnLoad.ran = True


@pytest.mark.ray
def test_a_run_starts_from_nanochats_weights_and_a_rerun_resumes_its_own(ray_session, tiny_corpus, tmp_path):
    """`--init-from-nanochat` through the real entry point: with every learning rate flag 0, the run's
    one step leaves the weights as nanochat's file holds them, bit for bit; the same command again
    resumes the run's own checkpoint instead."""
    from helpers import TINY, run_train, tiny_flags

    from raychat.checkpoint.catalog import latest_valid_checkpoint
    from raychat.checkpoint.reader import load_checkpoint

    tokenizer = Tokenizer.load(tiny_corpus[1])
    # The model TINY's flags build: depth 2, width 64 (2 heads of 32), T 64, window L.
    assert TINY[:10] == ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
                         "--window-pattern", "L"]
    config = GPTConfig(sequence_len=64, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, n_kv_head=2,
                       n_embd=64, window_pattern="L")
    model = trained_looking_model(config, seed=1)
    nanochat_dir = tmp_path / "nanochat" / "base_checkpoints" / "d2"
    nanochat_dir.mkdir(parents=True)
    torch.save(model.state_dict(), nanochat_dir / "model_000300.pt")  # as nanochat's save_checkpoint does
    meta = {"step": 300, "model_config": dataclasses.asdict(config)}
    (nanochat_dir / "meta_000300.json").write_text(json.dumps(meta))
    (tmp_path / "nanochat" / "tokenizer").mkdir()
    torch.save(tokenizer.token_bytes().to(torch.int32), tmp_path / "nanochat/tokenizer/token_bytes.pt")

    storage = tmp_path / "runs"
    flags = tiny_flags(tiny_corpus, storage, "from-nanochat", "--init-from-nanochat", str(nanochat_dir),
                       "--num-iterations", "1", "--total-batch-size", "256", "--eval-every", "-1",
                       "--dtype", "fp32", "--core-metric-every", "-1", "--embedding-lr", "0",
                       "--unembedding-lr", "0", "--matrix-lr", "0", "--scalar-lr", "0")
    result = run_train(ray_session, flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Starting from nanochat's {nanochat_dir / 'model_000300.pt'} (step 300)" in result.stdout
    trained, _, meta = load_checkpoint(latest_valid_checkpoint(Storage(str(storage)).child("from-nanochat")))
    assert meta.step == 1
    original = model.state_dict()
    assert trained.keys() == original.keys()
    # Only nanochat's smear set moves: its lr is a fixed 0.2, no flag sets it. backout_lambda may stay:
    # at depth 2 the backout layer is the last one, norm(x - lambda x) does not depend on lambda, and
    # whether its gradient rounds to exactly 0 depends on the CPU's kernels.
    moved = {name for name in original if not torch.equal(trained[name], original[name])}
    smear_set = {"backout_lambda", "smear_gate.weight", "smear_lambda"}
    assert {"smear_gate.weight", "smear_lambda"} <= moved <= smear_set

    again = run_train(ray_session, flags)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "--init-from-nanochat ignored: the run resumes from its own checkpoint_000001" in again.stdout
    assert "Starting from nanochat" not in again.stdout
