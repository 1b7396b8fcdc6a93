"""The data pipeline: formats, loss masks, packing without leakage, batches across ranks."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from finetune_trainer.config import DatasetSource
from finetune_trainer.data import (
    COMPLETION_FIX,
    IGNORE,
    DataError,
    GlobalBatches,
    batch_larger_than_data,
    check_records,
    collate,
    label_tokens,
    one_per_sequence,
    pack,
    pack_in_order,
    read_records,
    read_split,
    record_problem,
    resolve_format,
    tokenize_record,
    tokenize_records,
)
from tests.conftest import REPO

CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "What is a GPU?"},
                     {"role": "assistant", "content": "A parallel processor."},
                     {"role": "user", "content": "And FSDP?"},
                     {"role": "assistant", "content": "Sharded data parallel."}]}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trained_text(sample, tokenizer) -> str:
    return tokenizer.decode([t for t in sample["labels"] if t != IGNORE])


# --- reading and formats -------------------------------------------------------------------

def test_reads_the_shipped_chat_data():
    records = read_records(DatasetSource(uri="./examples/data/tiny-chat.jsonl"), base_dir=REPO)
    assert len(records) == 64
    assert resolve_format("auto", records.column_names) == "chat"


def test_reads_the_shipped_preference_data():
    records = read_records(DatasetSource(uri="./examples/data/tiny-preferences.jsonl"),
                           base_dir=REPO)
    assert len(records) == 64
    assert resolve_format("auto", records.column_names) == "preference"


@pytest.mark.parametrize(("columns", "expected"), [
    (["messages"], "chat"), (["prompt", "response"], "instruction"),
    (["instruction", "input", "output"], "instruction"), (["text", "id"], "text"),
    (["prompt", "chosen", "rejected"], "preference"),
    (["rejected", "chosen", "prompt", "response"], "preference"),
    (["prompt", "completion"], "instruction")])  # TRL's prompt-completion (#51, item 5)
def test_auto_detects_the_format(columns, expected):
    assert resolve_format("auto", columns) == expected


def test_missing_columns_name_what_was_found():
    with pytest.raises(DataError, match=r"format chat needs columns messages, found \['text'\]"):
        resolve_format("chat", ["text"])
    with pytest.raises(DataError, match="match no format"):
        resolve_format("auto", ["question", "answer"])
    with pytest.raises(DataError, match=r"format preference needs columns "
                                        r"chosen\+prompt\+rejected, found \['chosen', 'prompt'\]"
                       ) as refused:
        resolve_format("preference", ["prompt", "chosen"])
    # DPO trains on pairs alone: another format is no fix (it was offered)
    assert refused.value.fix == "add rejected to every record, or rename the columns that hold them"
    with pytest.raises(DataError) as refused:
        resolve_format("instruction", ["instruction", "input"])
    assert refused.value.fix == ("add output to every record, or rename the columns that hold "
                                 "them, or set spec.dataset.format to the data's format")
    with pytest.raises(DataError) as refused:  # half a pair is no format, and says so
        resolve_format("auto", ["prompt", "chosen"])
    assert refused.value.fix.endswith("`text`, `prompt`+`chosen`+`rejected` (preference, "
                                      "for objective dpo), or `prompt` (prompt, for "
                                      "objective grpo)")


def test_malformed_jsonl_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "broken"\n')
    with pytest.raises(DataError) as error:
        read_records(DatasetSource(uri=str(path)))
    assert error.value.where == f"{path}:3"
    assert "is not valid JSON" in error.value.what and error.value.fix == "fix or remove that line"
    # a line cut short: the column where it ends (18), not column 1 of what follows it
    assert error.value.what.endswith("(Expecting ',' delimiter, column 18)"), error.value.what


def test_an_unterminated_string_says_the_column_it_starts_at(tmp_path):
    """json's "Unterminated string starting at" names a place: the column follows it, not
    a comma (#51, item 9: it read "(Unterminated string starting at, column 103)")."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "cut short\n')
    with pytest.raises(DataError) as error:
        read_records(DatasetSource(uri=str(path)))
    assert error.value.where == f"{path}:2"
    assert error.value.what == "is not valid JSON (Unterminated string starting at column 10)"


def test_a_byte_order_mark_is_named_with_its_fix(tmp_path):
    """Python's own message, `Unexpected UTF-8 BOM (decode using utf-8-sig)`, named a codec."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "ok"}\n')
    with pytest.raises(DataError) as error:
        read_records(DatasetSource(uri=str(path)))
    assert (error.value.where, error.value.what, error.value.fix) == (
        f"{path}:1", "starts with a byte-order mark (BOM), which the JSON reader does not take",
        "save the file as UTF-8 without BOM")


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(DataError, match=r"does not exist — check spec\.dataset\.uri"):
        read_records(DatasetSource(uri=str(tmp_path / "nope.jsonl")))
    with pytest.raises(DataError, match=r"holds no \.jsonl"):
        read_records(DatasetSource(uri=str(tmp_path)))


def test_reads_a_folder_of_parquet_and_csv(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["a b", "c d"]}).to_parquet(str(tmp_path / "p1.parquet"))
    datasets.Dataset.from_dict({"text": ["e f"]}).to_parquet(str(tmp_path / "p2.parquet"))
    assert len(read_records(DatasetSource(uri=str(tmp_path)))) == 3
    csv_dir = tmp_path / "csv"
    csv_dir.mkdir()
    (csv_dir / "d.csv").write_text("prompt,response\nhi,hello\n")
    assert read_records(DatasetSource(uri=str(csv_dir))).column_names == ["prompt", "response"]


def test_a_data_files_suffix_is_read_in_any_case(tmp_path):
    """`TRAIN.JSONL`, as a Windows export names it: one data file to the API's rules (their
    expression is case-blind), so the trainer reads it too, where it had refused the
    extension '.JSONL'; and a folder of such files is read, where it had held none."""
    from finetune_trainer.uris import data_file_builder

    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "TRAIN.JSONL").write_text('{"text": "a b"}\n{"text": "c d"}\n')
    (upper / "Extra.Csv").write_text("text\ne f\n")
    assert len(read_records(DatasetSource(uri=str(upper / "TRAIN.JSONL")))) == 2
    with pytest.raises(DataError, match=r"mixes file types \(csv, json\)"):
        read_records(DatasetSource(uri=str(upper)))
    (upper / "Extra.Csv").unlink()
    assert len(read_records(DatasetSource(uri=str(upper)))) == 2
    assert data_file_builder("https://host/d/train.Parquet?sig=x") == "parquet"
    assert data_file_builder("pvc://data/v1.2") is None


def split_folder(root: Path, files: dict[str, int]) -> Path:
    """A folder of JSON Lines files, each record's text naming its file."""
    for name, count in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("".join(json.dumps({"text": f"{name} {i}"}) + "\n"
                                         for i in range(count)))
    return root


def files_read(records) -> dict[str, int]:
    return dict(Counter(text.split()[0] for text in records["text"]))


def test_a_folder_named_by_split_trains_on_its_split_and_evaluates_on_another(tmp_path):
    folder = split_folder(tmp_path, {"train.jsonl": 4, "dev.jsonl": 3, "test.jsonl": 2,
                                     ".ipynb_checkpoints/train-checkpoint.jsonl": 5})
    source = DatasetSource(uri=str(folder), evalSplit="validation")
    # the test split is never trained on; dev is datasets' name for validation; hidden
    # folders (an editor's copies) are skipped, as datasets skips them
    assert files_read(read_records(source)) == {"train.jsonl": 4}
    assert files_read(read_records(source, evaluation=True)) == {"dev.jsonl": 3}
    sliced = DatasetSource(uri=str(folder), split="train[:50%]", evalSplit="test")
    assert files_read(read_records(sliced)) == {"train.jsonl": 2}
    assert files_read(read_records(sliced, evaluation=True)) == {"test.jsonl": 2}
    # the log says which files each split reads
    assert read_split(source)[1] == f"{folder} split train (train.jsonl)"
    assert read_split(source, evaluation=True)[1] == f"{folder} split validation (dev.jsonl)"


def test_a_folder_whose_files_name_no_split_is_all_training_data(tmp_path):
    folder = split_folder(tmp_path, {"chats-a.jsonl": 2, "more/chats-b.jsonl": 3})
    assert files_read(read_records(DatasetSource(uri=str(folder)))) == {
        "chats-a.jsonl": 2, "more/chats-b.jsonl": 3}


def test_splits_a_folder_does_not_name_clearly_are_refused(tmp_path):
    stray = split_folder(tmp_path / "stray", {"train.jsonl": 2, "extra.jsonl": 1})
    with pytest.raises(DataError) as error:
        read_records(DatasetSource(uri=str(stray)))
    assert error.value.where == str(stray / "extra.jsonl")
    assert error.value.what.endswith("name theirs (train: train.jsonl)")
    assert error.value.fix.startswith("name it by its split (e.g. train-extra.jsonl)")

    missing = split_folder(tmp_path / "missing", {"train.jsonl": 2, "test.jsonl": 1})
    with pytest.raises(DataError) as error:
        read_records(DatasetSource(uri=str(missing), evalSplit="validation"), evaluation=True)
    assert str(error.value) == (f"{missing}: has no validation split (train: train.jsonl; "
                                "test: test.jsonl) — set spec.dataset.evalSplit to test, or "
                                "name the files by split (train.jsonl, validation.jsonl, "
                                "test.jsonl)")

    both = split_folder(tmp_path / "both", {"train.jsonl": 2, "train-test.jsonl": 1})
    with pytest.raises(DataError, match="is named by two splits \\(train and test\\)"):
        read_records(DatasetSource(uri=str(both)))


def test_one_file_is_split_train_and_evaluates_on_a_slice_of_it(tmp_path):
    path = split_folder(tmp_path, {"chats.jsonl": 10}) / "chats.jsonl"
    assert len(read_records(DatasetSource(uri=str(path), split="anything"))) == 10
    sliced = DatasetSource(uri=str(path), split="train[:80%]", evalSplit="train[80%:]")
    assert read_records(sliced)["text"] == [f"chats.jsonl {i}" for i in range(8)]
    assert read_records(sliced, evaluation=True)["text"] == ["chats.jsonl 8", "chats.jsonl 9"]
    assert read_split(sliced, evaluation=True)[1] == f"{path} split train[80%:]"
    assert read_split(DatasetSource(uri=str(path)))[1] == str(path)
    with pytest.raises(DataError) as refused:
        read_records(DatasetSource(uri=str(path), evalSplit="validation"), evaluation=True)
    assert str(refused.value) == (
        f"{path}: is one file (split train), with no validation split to evaluate on — point "
        "spec.dataset.uri at a folder of train and validation files (e.g. train.jsonl, "
        "validation.jsonl), evaluate on a slice of this one (split: train[:95%], evalSplit: "
        "train[95%:]), or use evalFraction")
    with pytest.raises(DataError, match=r"is one file \(split train\), with no validation"):
        read_records(DatasetSource(uri="https://example.com/d.jsonl", evalSplit="validation"),
                     evaluation=True)


# --- loss masks ----------------------------------------------------------------------------

def test_chat_trains_only_on_assistant_turns(tiny_tokenizer):
    sample = tokenize_record(CHAT, "chat", tiny_tokenizer, max_length=512)
    assert len(sample["input_ids"]) == len(sample["labels"])
    assert trained_text(sample, tiny_tokenizer) == (
        "A parallel processor.<|end|>\nSharded data parallel.<|end|>\n")


def test_instruction_trains_only_on_the_response(tiny_tokenizer):
    alpaca = tokenize_record({"instruction": "Define DDP", "input": "briefly",
                              "output": "Replicated model."}, "instruction", tiny_tokenizer, 512)
    assert trained_text(alpaca, tiny_tokenizer) == "Replicated model.<|end|>"
    prompt_response = tokenize_record({"prompt": "Q: why? A:", "response": " because"},
                                      "instruction", tiny_tokenizer, 512)
    assert trained_text(prompt_response, tiny_tokenizer) == " because<|end|>"


def test_trls_prompt_completion_trains_only_on_the_completion(tiny_tokenizer, tmp_path):
    """#51, item 5: TRL's prompt-completion layout, as text and as conversations (the
    completion's assistant turns trained on, not an assistant turn of the prompt), read
    from a JSON Lines file through the same path as a run."""
    text = {"prompt": "Q: why? A:", "completion": " because"}
    conversation = {"prompt": CHAT["messages"][:4],
                    "completion": [{"role": "assistant", "content": "Sharded data parallel."}]}
    for rows, trained in (([text], " because<|end|>"),
                          ([conversation], "Sharded data parallel.<|end|>\n")):
        write_jsonl(tmp_path / "data.jsonl", rows)
        records = read_records(DatasetSource(uri=str(tmp_path / "data.jsonl")))
        fmt = resolve_format("auto", records.column_names)
        check_records(records, fmt, lambda index: f"record {index + 1}")
        (sample,) = tokenize_records(records, fmt, tiny_tokenizer, 512)
        assert trained_text(sample, tiny_tokenizer) == trained
    half = {"prompt": CHAT["messages"][:2], "completion": "Sharded data parallel."}
    assert record_problem(half, "instruction") == (
        "`completion` is text \"Sharded data parallel.\", not a list of messages", COMPLETION_FIX)


def test_text_trains_on_everything_but_the_first_token(tiny_tokenizer):
    sample = tokenize_record({"text": "What is a token?"}, "text", tiny_tokenizer, 512)
    assert sample["labels"][0] == IGNORE
    assert sample["labels"][1:] == sample["input_ids"][1:]


def test_truncation_and_samples_left_without_labels(tiny_tokenizer):
    long = {"messages": [{"role": "user", "content": "What is warmup? " * 40},
                         {"role": "assistant", "content": "Slow start."}]}
    assert len(tokenize_record(long, "chat", tiny_tokenizer, 32)["input_ids"]) == 32
    kept = tokenize_records([long, CHAT], "chat", tiny_tokenizer, 32)
    assert len(kept) == 1  # the long one lost its answer to truncation


# --- packing -------------------------------------------------------------------------------

def samples_of(lengths):
    out = []
    for n, length in enumerate(lengths):
        ids = [100 + n] * length
        out.append({"input_ids": ids, "labels": [IGNORE, *ids[1:]]})
    return out


def test_pack_keeps_every_token_and_restarts_positions():
    samples = samples_of([5, 3, 7, 2, 8])
    sequences = pack(samples, max_length=10)
    # longest first, each into the open sequence with the least room: 8+2, 7+3, 5
    assert [len(s["input_ids"]) for s in sequences] == [10, 10, 5]
    assert sum(label_tokens(s) for s in sequences) == sum(len(s["input_ids"]) - 1 for s in samples)
    assert sequences[0]["input_ids"] == [104] * 8 + [103] * 2
    assert sequences[0]["position_ids"] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    # the first token of every packed sample carries no loss
    assert [lab for lab, pos in zip(sequences[1]["labels"], sequences[1]["position_ids"],
                                    strict=True) if pos == 0] == [IGNORE, IGNORE]


def test_pack_in_order_joins_consecutive_samples():
    sequences = pack_in_order(samples_of([5, 3, 7, 2, 8]), max_length=10)
    assert [len(s["input_ids"]) for s in sequences] == [8, 9, 8]
    assert sequences[0]["position_ids"] == [0, 1, 2, 3, 4, 0, 1, 2]


def test_pack_fills_sequences_on_long_tailed_lengths():
    """Instruction data: many short samples, a long tail. Every sample lands in exactly one
    sequence, none overflows, and far fewer sequences (less padding) than in order."""
    rng = random.Random(0)
    lengths = [min(int(rng.lognormvariate(4.0, 0.9)) + 8, 512) for _ in range(3000)]
    samples = samples_of(lengths)
    best, in_order = pack(samples, 512), pack_in_order(samples, 512)
    assert max(len(s["input_ids"]) for s in best) <= 512
    assert Counter(t for s in best for t in s["input_ids"]) == Counter(
        t for s in samples for t in s["input_ids"])
    fill = sum(lengths) / (len(best) * 512)
    assert fill > 0.99 and len(best) < 0.9 * len(in_order), (fill, len(best), len(in_order))


def test_packed_loss_equals_unpacked_loss(tiny_model_dir, tiny_tokenizer):
    """No attention or position leaks between packed samples: same token losses."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    records = [json.loads(line) for line in
               (REPO / "examples/data/tiny-chat.jsonl").read_text().splitlines()[:6]]
    samples = tokenize_records(records, "chat", tiny_tokenizer, max_length=256)

    def summed_loss(sequences):
        batch = collate(sequences, tiny_tokenizer.pad_token_id)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                           use_cache=False).logits.float()
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1),
            ignore_index=IGNORE, reduction="sum")

    packed = pack(samples, max_length=256)
    assert len(packed) < len(samples)
    unpacked = summed_loss(one_per_sequence(samples))
    assert torch.allclose(summed_loss(packed), unpacked, rtol=1e-4)
    # and the check has teeth: with positions running on, samples see each other
    leaky = [{**s, "position_ids": list(range(len(s["input_ids"])))} for s in packed]
    assert not torch.allclose(summed_loss(leaky), unpacked, rtol=1e-4)


# --- batches across ranks ------------------------------------------------------------------

def test_every_sequence_once_per_epoch_across_ranks():
    batches = GlobalBatches(num_sequences=23, micro_batch=2, accumulation=2, world_size=3, seed=7)
    for epoch in range(2):
        seen = Counter(i for step in range(batches.steps_per_epoch) for rank in range(3)
                       for micro in batches.micro_batches(epoch, step, rank) for i in micro)
        assert seen == Counter(range(23))
    assert batches.order(0) != batches.order(1)
    assert batches.order(0) == GlobalBatches(23, 2, 2, 3, seed=7).order(0)


def test_two_ranks_see_what_one_rank_with_double_accumulation_sees():
    two = GlobalBatches(num_sequences=40, micro_batch=4, accumulation=1, world_size=2, seed=1)
    one = GlobalBatches(num_sequences=40, micro_batch=4, accumulation=2, world_size=1, seed=1)
    assert two.steps_per_epoch == one.steps_per_epoch == 5
    for step in range(5):
        by_two = sorted(i for r in range(2) for m in two.micro_batches(0, step, r) for i in m)
        by_one = sorted(i for m in one.micro_batches(0, step, 0) for i in m)
        assert by_two == by_one


@pytest.mark.parametrize(("sequences", "per_device", "accumulation", "world", "said"), [
    (16, 4, 1, 2, None),
    (5, 4, 1, 2, "every step trains on all of it — set hyperparameters.batchSizePerDevice to 2"),
    (3, 4, 2, 2, "every step trains on all of it — set hyperparameters.batchSizePerDevice to 1 "
                 "and gradientAccumulationSteps to 1"),
    (3, 4, 1, 8, "every step trains on all of it, and 6 of the 8 processes get none — run on 3 "
                 "processes or fewer"),
])
def test_a_batch_larger_than_the_data_is_warned_about(sequences, per_device, accumulation,
                                                      world, said):
    batches = GlobalBatches(sequences, min(per_device, 2), per_device * accumulation
                            // min(per_device, 2), world, seed=0)
    warning = batch_larger_than_data(batches, per_device, accumulation, packed=True)
    if said is None:
        assert warning is None
        return
    assert warning.startswith(f"warning: the data is {sequences} sequences after packing, "
                              f"fewer than one step's batch of {per_device * accumulation * world}")
    assert warning.endswith(said + ", or add data")
    idle = [r for r in range(world) if not any(batches.micro_batches(0, 0, r)[a]
                                               for a in range(batches.accumulation))]
    assert len(idle) == batches.idle_ranks()


def test_schedule_resumes_mid_epoch():
    batches = GlobalBatches(num_sequences=10, micro_batch=2, accumulation=1, world_size=1, seed=0)
    schedule = batches.schedule(start_step=6)
    assert [next(schedule) for _ in range(3)] == [(1, 1), (1, 2), (1, 3)]


def test_collate_pads_and_fills_empty_micro_batches():
    batch = collate([{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7], "position_ids": [0, 1, 2]},
                     {"input_ids": [8], "labels": [IGNORE], "position_ids": [0]}], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [IGNORE, IGNORE, IGNORE]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 1]]
    empty = collate([], pad_id=0)
    assert empty["labels"].tolist() == [[IGNORE]]
    assert "answers" not in empty and "pairs" not in empty


def test_collate_of_pairs_pads_their_answers_and_fills_empty_micro_batches():
    """Preference pairs (`data.pair_sample`): padding belongs to no answer (-1); a rank
    with nothing left still runs a forward, over no pair."""
    import torch

    pair = {"input_ids": [5, 6, 5, 7], "labels": [IGNORE, 6, IGNORE, 7],
            "position_ids": [0, 1, 0, 1], "answers": [-1, 0, -1, 1], "pairs": [3]}
    batch = collate([pair], pad_id=0, width=6, paired=True)
    assert batch["answers"].tolist() == [[-1, 0, -1, 1, -1, -1]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 0, 1]]  # padding: its own segment
    assert batch["pairs"].tolist() == [3]
    empty = collate([], pad_id=0, paired=True)
    assert empty["labels"].tolist() == [[IGNORE]] and empty["answers"].tolist() == [[-1]]
    assert empty["pairs"].tolist() == [] and empty["pairs"].dtype == torch.long


def test_collate_fills_a_short_micro_batch_to_its_rows_with_padding():
    """Compiled layers on packed rows see one shape: an epoch's last, short micro-batch
    gets padding rows (no label, no answer, no pair) instead of a recompile."""
    pair = {"input_ids": [5, 6, 5, 7], "labels": [IGNORE, 6, IGNORE, 7],
            "position_ids": [0, 1, 0, 1], "answers": [-1, 0, -1, 1], "pairs": [3]}
    batch = collate([pair], pad_id=0, width=6, paired=True, rows=3)
    assert batch["input_ids"].shape == (3, 6)
    assert batch["labels"][1:].eq(IGNORE).all() and batch["answers"][1:].eq(-1).all()
    assert batch["position_ids"][1:].tolist() == [[0, 0, 1, 2, 3, 4]] * 2  # segments of their own
    assert batch["pairs"].tolist() == [3]
    full = collate([pair] * 3, pad_id=0, width=6, paired=True, rows=2)  # never cut
    assert full["input_ids"].shape == (3, 6)


def test_prefetched_keeps_order_and_raises_errors_where_read():
    from finetune_trainer.data import Prefetched

    def make(key):
        if key == 3:
            raise ValueError("bad step")
        return key * 10

    ahead = Prefetched(iter(range(5)), make)
    assert [next(ahead) for _ in range(3)] == [(0, 0), (1, 10), (2, 20)]
    with pytest.raises(ValueError, match="bad step"):
        next(ahead)
