"""Whatever data a user points the trainer at, the preflight answers with a DataError that
says where, what and how to fix it, or with valid training sequences — never a traceback.

The inputs are corrupt on purpose: truncated JSON Lines, bytes that are not UTF-8, columns
of the wrong type (nulls, numbers, lists, objects where text belongs), empty files, binary
garbage under every extension, parquet files with odd schemas or cut short, CSV junk. They
go through `train.preflight`, the code every worker and `finetune run` run before training
(read_records → resolve_format → the eval split → tokenize_records → packing).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from finetune_trainer.config import ModelSource, TrainerConfig
from finetune_trainer.data import IGNORE, DataError
from finetune_trainer.model import ModelError, load_tokenizer
from finetune_trainer.train import preflight
from tests.conftest import REPO
from tests.support import waits

pytestmark = pytest.mark.process

_SHIPPED = (REPO / "examples/data/tiny-chat.jsonl").read_bytes()
GOOD_JSONL = _SHIPPED[:_SHIPPED.index(b"\n", 3000) + 1]  # a few whole conversations
COLUMNS = ["messages", "text", "prompt", "response", "instruction", "input", "output", "id",
           "chosen", "rejected"]
MAX_LENGTH = 48

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)
messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                           "content": st.text(max_size=30)}),
    st.fixed_dictionaries({}, optional={"role": json_values, "content": json_values}),
    json_values), max_size=4)
records = st.dictionaries(st.sampled_from(COLUMNS),
                          st.one_of(st.text(max_size=30), json_values, messages),
                          min_size=1, max_size=4)
words = st.text(st.characters(codec="utf-8"), max_size=40)
turn = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                              "content": words})
said = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
answer_turns = st.lists(st.fixed_dictionaries({"role": st.just("assistant"), "content": words}),
                       min_size=1, max_size=2)
pairs = st.one_of(  # preference records (objective dpo), as text and as chat messages
    st.fixed_dictionaries({"prompt": said, "chosen": said, "rejected": said}),
    st.fixed_dictionaries({"prompt": st.lists(turn, min_size=1, max_size=3),
                           "chosen": answer_turns, "rejected": answer_turns}))
usable = st.one_of(  # records of every format as a user would write them
    st.fixed_dictionaries({"messages": st.lists(turn, min_size=1, max_size=4)}),
    st.fixed_dictionaries({"prompt": words, "response": words}),
    st.fixed_dictionaries({"instruction": words, "output": words}, optional={"input": words}),
    st.fixed_dictionaries({"text": words}, optional={"id": st.integers()}),
    pairs)


@st.composite
def mostly_usable(draw, records=usable) -> list[dict]:
    """Usable records, one of them perhaps spoiled: a field set to any JSON value."""
    rows = draw(st.lists(records, min_size=1, max_size=5))
    if draw(st.booleans()):
        row = draw(st.sampled_from(rows))
        row[draw(st.sampled_from(sorted(row) + COLUMNS))] = draw(json_values)
    return rows


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """`data` truncated, with bytes flipped or inserted, or replaced by garbage."""
    how = draw(st.sampled_from(["truncate", "flip", "insert", "garbage", "empty", "keep"]))
    if how == "truncate":
        return data[:draw(st.integers(0, len(data)))]
    if how == "flip" and data:
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
    if how == "insert":
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
    if how == "garbage":
        return draw(st.binary(max_size=300))
    return b"" if how == "empty" else data


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


@st.composite
def parquet_file(draw) -> bytes:
    """A real parquet file whose columns hold one arbitrary type each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = draw(st.integers(0, 4))
    kinds = {
        "string": st.text(max_size=20), "int": st.integers(-1000, 1000),
        "null": st.none(), "binary": st.binary(max_size=10),
        "strings": st.lists(st.text(max_size=5), max_size=3),
        "message": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user",
                                                                            "assistant"]),
                                                   "content": st.one_of(st.none(),
                                                                        st.text(max_size=9))}),
                            max_size=3),
    }
    columns = {}
    for name in draw(st.lists(st.sampled_from(COLUMNS), min_size=1, max_size=3, unique=True)):
        kind = draw(st.sampled_from(sorted(kinds)))
        columns[name] = pa.array([draw(kinds[kind]) for _ in range(rows)],
                                 type=pa.null() if kind == "null" else None)
    buffer = io.BytesIO()
    pq.write_table(pa.table(columns), buffer)
    return buffer.getvalue()


@st.composite
def csv_file(draw) -> bytes:
    header = draw(st.lists(st.sampled_from(COLUMNS), min_size=1, max_size=3, unique=True))
    cell = st.text(alphabet=st.sampled_from('ab ,"\n\r;\\x1'), max_size=8)
    lines = [",".join(header)] + [",".join(draw(st.lists(cell, max_size=4)))
                                  for _ in range(draw(st.integers(0, 4)))]
    return "\n".join(lines).encode()


data_files = st.one_of(
    st.tuples(st.just(".jsonl"), mutated(GOOD_JSONL)),
    st.tuples(st.just(".jsonl"), mostly_usable().map(jsonl)),
    st.tuples(st.just(".json"), mostly_usable().map(lambda rows: json.dumps(rows).encode())),
    st.tuples(st.just(".jsonl"), st.lists(records, max_size=4).map(jsonl).flatmap(mutated)),
    st.tuples(st.just(".jsonl"), st.lists(records, min_size=1, max_size=4).map(jsonl)),
    st.tuples(st.just(".json"), st.lists(records, max_size=4).map(
        lambda rows: json.dumps(rows).encode()).flatmap(mutated)),
    st.tuples(st.just(".parquet"), parquet_file().flatmap(mutated)),
    st.tuples(st.just(".csv"), csv_file().flatmap(mutated)),
    st.tuples(st.sampled_from([".jsonl", ".json", ".csv", ".parquet"]), st.binary(max_size=200)),
)


def config(data: Path, model: Path, out: Path, fmt: str, eval_fraction: float,
           packing: bool, objective: str = "sft") -> TrainerConfig:
    return TrainerConfig.model_validate({
        "job": {"name": "fuzz"}, "model": {"uri": str(model)},
        "dataset": {"uri": str(data), "format": fmt, "maxSeqLength": MAX_LENGTH,
                    "evalFraction": eval_fraction, "packing": packing},
        "method": {"type": "lora"}, "objective": {"type": objective},
        "strategy": {"type": "ddp"}, "hyperparameters": {"maxSteps": 1},
        "output": {"uri": str(out)}})


@pytest.fixture(scope="module")
def datasets_cache(tmp_path_factory):
    """The datasets cache of this module's many loads, thrown away with it."""
    import datasets

    before = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = str(tmp_path_factory.mktemp("datasets-cache"))
    yield
    datasets.config.HF_DATASETS_CACHE = before


def prepared_or_refused(file: tuple[str, bytes], model: Path, fmt: str, eval_fraction: float,
                        packing: bool, objective: str):
    """`train.preflight` of the file; None when it was refused as it should be: a DataError
    that says where, what and how to fix it."""
    suffix, content = file
    with tempfile.TemporaryDirectory() as where:
        path = Path(where) / f"train{suffix}"
        path.write_bytes(content)
        try:
            return preflight(config(path, model, Path(where) / "out", fmt, eval_fraction,
                                    packing, objective), Path(where))
        except DataError as error:
            assert error.what and error.fix, str(error)
            assert str(path) in error.where or error.where.startswith("dataset"), str(error)
            return None


def check_pairs(prepared) -> None:
    """Preference pairs (objective dpo): each pair whole in one sequence, its two sides from
    position 0 and at most maxSeqLength each, its answers 2k and 2k + 1 in the sequence
    (k: its place in `pairs`) and labelled exactly there, every pair once, the eval
    split's numbered after the training split's."""
    for sequence in prepared.train + prepared.eval:
        answers, labels, positions = (sequence[k] for k in ("answers", "labels",
                                                            "position_ids"))
        assert len(answers) == len(labels)
        assert [a >= 0 for a in answers] == [label != IGNORE for label in labels]
        assert set(answers) - {-1} == set(range(2 * len(sequence["pairs"])))
        assert positions.count(0) == 2 * len(sequence["pairs"]) and max(positions) < MAX_LENGTH
        # an answer's first token is predicted from its own prompt, never from the sequence
        # before it (another side, another pair)
        assert all(p > 0 for p, a in zip(positions, answers, strict=True) if a >= 0)
    train = sorted(p for s in prepared.train for p in s["pairs"])
    evaluation = sorted(p for s in prepared.eval for p in s["pairs"])
    assert train + evaluation == list(range(len(train) + len(evaluation)))


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(file=data_files,
       fmt=st.sampled_from(["auto", "auto", "chat", "instruction", "text", "preference"]),
       eval_fraction=st.sampled_from([0.0, 0.0, 0.5]), packing=st.booleans(),
       objective=st.sampled_from(["sft", "sft", "dpo"]))
def test_any_data_file_gives_a_clear_error_or_valid_sequences(
        tiny_model_dir, datasets_cache, file, fmt, eval_fraction, packing, objective):
    prepared = prepared_or_refused(file, tiny_model_dir, fmt, eval_fraction, packing,
                                   objective)
    if prepared is None:
        return
    assert prepared.train  # the preflight refuses data with nothing to train on
    longest = MAX_LENGTH * (2 if objective == "dpo" else 1)  # dpo: two sides to a pair
    for sequence in prepared.train + prepared.eval:
        ids, labels, positions = (sequence[k] for k in ("input_ids", "labels",
                                                        "position_ids"))
        assert 0 < len(ids) == len(labels) == len(positions) <= longest
        assert all(isinstance(t, int) and 0 <= t < len(prepared.tokenizer) for t in ids)
        assert all(label in (IGNORE, token) for label, token in zip(labels, ids, strict=True))
    assert any(label != IGNORE for s in prepared.train for label in s["labels"])
    if objective == "dpo":
        check_pairs(prepared)


pair_files = st.one_of(
    st.tuples(st.just(".jsonl"), mostly_usable(pairs).map(jsonl)),
    st.tuples(st.just(".jsonl"), mostly_usable(pairs).map(jsonl).flatmap(mutated)),
    st.tuples(st.just(".json"), mostly_usable(pairs).map(lambda rows: json.dumps(rows).encode())),
)


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(file=pair_files, fmt=st.sampled_from(["auto", "preference"]),
       eval_fraction=st.sampled_from([0.0, 0.5]), packing=st.booleans())
def test_any_preference_file_gives_a_clear_error_or_valid_pairs(
        tiny_model_dir, datasets_cache, file, fmt, eval_fraction, packing):
    """The data fuzz on the preference format: pairs as text and as chat messages, one of
    them perhaps spoiled, the file perhaps cut or garbled."""
    prepared = prepared_or_refused(file, tiny_model_dir, fmt, eval_fraction, packing, "dpo")
    if prepared is None:
        return
    assert prepared.train
    for sequence in prepared.train + prepared.eval:
        ids, labels = sequence["input_ids"], sequence["labels"]
        assert 0 < len(ids) == len(sequence["position_ids"]) <= 2 * MAX_LENGTH
        assert all(isinstance(t, int) and 0 <= t < len(prepared.tokenizer) for t in ids)
        assert all(label in (IGNORE, token) for label, token in zip(labels, ids, strict=True))
        assert len(sequence["pairs"]) == 1 or packing
    check_pairs(prepared)


@pytest.mark.parametrize(("name", "content", "expected"), [
    ("latin1.jsonl", b'{"text": "caf\xe9"}\n', ":1: is not UTF-8 text (byte 0xe9 at column 14)"),
    ("nulls.jsonl", b'{"text": "fine"}\n{"text": null}\n', ":2: `text` is null, not text"),
    ("no-turns.jsonl", b'{"messages": []}\n', ":1: `messages` is an empty conversation"),
    ("cut.parquet", b"PAR1\x15\x04", ": cannot be read as parquet (ArrowInvalid: "),
])
def test_the_worker_preflight_names_the_file_and_exits_2(tiny_model_dir, tmp_path, name,
                                                         content, expected):
    """As `finetune-train --preflight` reports it: one line, exit 2, no traceback."""
    data = tmp_path / name
    data.write_bytes(content)
    path = tmp_path / "trainer.json"
    path.write_text(config(data, tiny_model_dir, tmp_path / "out", "auto", 0.0,
                           True).model_dump_json(by_alias=True))
    result = subprocess.run([sys.executable, "-m", "finetune_trainer", "--config", str(path),
                             "--preflight"], capture_output=True, text=True,
                            timeout=waits.seconds_left())
    assert result.returncode == 2, result.stderr
    assert f"finetune-train: {data}{expected}" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_eval_split_laid_out_unlike_the_training_split_is_refused(tiny_model_dir,
                                                                     tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "a b c"}\n')
    (tmp_path / "data" / "validation.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    job = config(tmp_path / "data", tiny_model_dir, tmp_path / "out", "auto", 0.0, True)
    job.dataset.eval_split = "validation"
    with pytest.raises(DataError) as refused:
        preflight(job, tmp_path)
    assert str(refused.value) == (f"{tmp_path / 'data'}: its validation split is laid out as "
                                  "instruction, its train split as text — lay both splits "
                                  "out in one format (the same columns)")


def test_a_chat_without_an_assistant_turn_names_the_roles_it_has(tiny_model_dir, tmp_path):
    """`role: bot` read as `no sample with a trained token after truncation — raise
    maxSeqLength`: a fix that could never work."""
    data = tmp_path / "bot.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, '
                    '{"role": "bot", "content": "hello"}]}\n')
    job = config(data, tiny_model_dir, tmp_path / "out", "chat", 0.0, True)
    with pytest.raises(DataError) as refused:
        preflight(job, tmp_path)
    assert str(refused.value) == (
        f"{data}: has no message with role assistant, the turns trained on (its roles: bot, "
        "user) — name the model's turns `assistant` (and the others `system` or `user`)")


def test_chat_data_on_a_tokenizer_without_a_chat_template_is_refused_once(tiny_model_dir,
                                                                         tmp_path):
    """Was each record's `cannot be tokenized (ValueError: Cannot use chat template
    functions ...)`, the fix offered being to edit the record."""
    import shutil

    model = tmp_path / "base"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("chat_template.jinja"))
    job = config(REPO / "examples/data/tiny-chat.jsonl", model, tmp_path / "out", "chat", 0.0,
                 True)
    with pytest.raises(ModelError) as refused:
        preflight(job, tmp_path)
    assert str(refused.value) == (
        f"{model}: its tokenizer has no chat template, which turns the data's conversations "
        "(format chat) into tokens — use a chat or instruct model, whose tokenizer has one, "
        "add a chat_template.jinja to the model's folder, or lay the data out as text or "
        "instruction records (spec.dataset.format)")


def test_a_model_folder_without_a_tokenizer_says_so(tiny_model_dir, tmp_path):
    """On a cluster no `finetune run` looks first: the trainer said `Couldn't instantiate
    the backend tokenizer ... install sentencepiece or tiktoken`."""
    import shutil

    model = tmp_path / "weights-only"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("tokenizer.json"))
    with pytest.raises(ModelError) as refused:
        load_tokenizer(ModelSource(uri=str(model)))
    assert str(refused.value) == (
        f"{model}: holds no tokenizer (tokenizer.json, tokenizer.model or vocabulary files) — "
        "save the model's tokenizer into the folder as well: "
        "tokenizer.save_pretrained(<the folder>)")
