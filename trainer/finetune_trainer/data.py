"""Training data: read, tokenise with loss masks, pack, and batch the same way on every rank.

The pipeline is `read_records` → `tokenize_records` → `pack` (or `one_per_sequence`) →
`GlobalBatches` → `collate`. Everything up to the batches is plain data (lists of ints),
so it is tested without a model; only `collate` makes tensors.

Two conventions hold throughout:
- `labels` are aligned with `input_ids` (the model shifts them); a label of IGNORE carries
  no loss. The first token of every sample is IGNORE, so in a packed sequence no token
  is trained to follow the previous sample.
- `position_ids` restart at 0 for every sample and no attention mask is passed: the
  model then attends only within each sample (transformers builds the block-diagonal
  mask from the restarts; flash-attention uses them as sequence boundaries). The model
  must run with `use_cache=False`: with a KV cache transformers skips that detection and
  packed samples silently attend to each other (tests/trainer/test_data.py shows both).
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import random
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from datasets.data_files import get_data_patterns, resolve_pattern
from jinja2.exceptions import TemplateError

from finetune_trainer.config import DatasetFormat, DatasetSource
from finetune_trainer.data_files import DataError, local_data_files
from finetune_trainer.data_files import local_path as _local_path
from finetune_trainer.uris import data_file_builder

IGNORE = -100
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"


# --- reading -----------------------------------------------------------------------------

def local_splits(files: list[Path], root: Path) -> dict[str, list[Path]]:
    """A folder's data `files` (`local_data_files`) by split, named as Hugging Face
    datasets names them: files or folders called `train*`, `validation*` / `valid*` /
    `dev*` / `val*`, `test*` / `eval*` (`datasets.data_files.get_data_patterns`); all of
    them `train` where none is named so. Unlike `load_dataset`, a file left out of every
    split is refused, not skipped."""
    patterns = {str(name): found for name, found in get_data_patterns(str(root)).items()}
    if patterns == {"train": ["**"]}:  # no file names a split
        return {"train": files}
    named: dict[str, set[Path]] = {split: set() for split in patterns}
    for split, split_patterns in patterns.items():
        for pattern in split_patterns:
            # datasets raises FileNotFoundError where a pattern matches nothing
            with contextlib.suppress(FileNotFoundError):
                named[split].update(Path(p) for p in resolve_pattern(pattern, str(root)))
    splits = {split: [f for f in files if f in paths] for split, paths in named.items()}
    for f in files:
        in_splits = [split for split, paths in named.items() if f in paths]
        if not in_splits:
            raise DataError(str(f), f"belongs to no split, while other files in {root} name "
                            f"theirs ({_show_splits(splits, root)})",
                            f"name it by its split (e.g. train-{f.name}), or move it out of "
                            "the folder")
        if len(in_splits) > 1:
            raise DataError(str(f), f"is named by two splits ({' and '.join(in_splits)})",
                            "rename it so its name holds one of train, validation or test")
    return {split: found for split, found in splits.items() if found}


def _show_splits(splits: dict[str, list[Path]], root: Path) -> str:
    return "; ".join(f"{split}: {', '.join(str(f.relative_to(root)) for f in found)}"
                     for split, found in splits.items() if found)


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 file; a line that is not UTF-8 is named."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{path}:{number}", f"is not UTF-8 text (byte "
                                f"0x{raw[error.start]:02x} at column {error.start + 1})",
                                "save the file as UTF-8, or fix or remove that line") from None


def check_text(path: Path) -> None:
    """Refuse a text data file (csv, json) that is not UTF-8, naming the first bad line."""
    for _ in _text_lines(path):
        pass


def check_jsonl(path: Path) -> list[int]:
    """Refuse a malformed JSON Lines file, naming the first bad line; returns the line
    number of every record (blank lines hold none)."""
    records = []
    for number, line in _text_lines(path):
        if number == 1 and line.startswith("\ufeff"):  # editors on Windows write one
            raise DataError(f"{path}:1", "starts with a byte-order mark (BOM), which the "
                            "JSON reader does not take", "save the file as UTF-8 without BOM")
        if not line.strip():
            continue
        try:
            value = json.loads(line.rstrip("\r\n"))  # a column past the end, not 1 of a next line
        except json.JSONDecodeError as error:
            # json's messages that end in "at" name the place themselves ("Unterminated
            # string starting at", column N); the others say what was expected there
            at = " " if error.msg.endswith(" at") else ", "
            raise DataError(f"{path}:{number}", f"is not valid JSON ({error.msg}{at}column "
                            f"{error.colno})", "fix or remove that line") from error
        except RecursionError:
            raise DataError(f"{path}:{number}", "nests JSON too deeply to read",
                            "flatten that record, or remove it") from None
        if not isinstance(value, dict):
            raise DataError(f"{path}:{number}", f"is a JSON {type(value).__name__}, not an "
                            "object", "write one JSON object per line")
        records.append(number)
    if not records:
        raise DataError(str(path), "holds no records (only blank lines)",
                        "write one JSON object per line, or remove the file")
    return records


def _root_cause(error: BaseException) -> str:
    """The innermost error's type and first line: what a loader really tripped on."""
    for _ in range(20):
        inner = error.__cause__ or error.__context__
        if inner is None:
            break
        error = inner
    text = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def read_records(source: DatasetSource, base_dir: Path | None = None,
                 evaluation: bool = False):
    """The split of the dataset `source` names that is trained on (`evaluation`: its
    `evalSplit`), as a `datasets.Dataset`."""
    return read_split(source, base_dir, evaluation)[0]


def read_split(source: DatasetSource, base_dir: Path | None = None,
               evaluation: bool = False):
    """`read_records`, and where the records came from, for the log: `<uri> split <split>`,
    with a folder's files, since their names chose them."""
    uri = source.uri
    split = source.eval_split if evaluation else source.split
    if uri.startswith("hf://"):
        try:
            records = datasets.load_dataset(uri.removeprefix("hf://"), split=split)
        except Exception as error:  # network, auth, missing split: all end the run here
            field = f"spec.dataset.{'evalSplit' if evaluation else 'split'}"
            raise DataError(uri, f"cannot be loaded from the hub ({error})",
                            f"check the name, the split ({field}: {split}), network access "
                            "and HF_TOKEN; or copy the data to a PVC") from error
        check_records(records, _format_of(source, records, uri),
                      lambda index: f"{uri} record {index + 1}")
        return records, f"{uri} split {split}"
    if uri.startswith("https://"):
        builder = data_file_builder(uri)
        if builder is None:
            raise DataError(uri, "does not end in .jsonl, .json, .parquet or .csv",
                            "link to a data file of one of those kinds")
        split = _of_one_file(uri, split, evaluation)
        try:
            records = datasets.load_dataset(builder, data_files=uri, split=split)
        except Exception as error:
            raise DataError(uri, f"cannot be read as {builder} ({_root_cause(error)})",
                            "check the link and that it serves a valid data file") from error
        check_records(records, _format_of(source, records, uri),
                      lambda index: f"{uri} record {index + 1}")
        return records, _said(uri, split)
    files, split = local_split_files(source, base_dir, evaluation)
    root = _local_path(uri, base_dir)
    return (_read_files(source, files, split),
            _said(str(root), split, files if root.is_dir() else None))


def _read_files(source: DatasetSource, files: list[Path], split: str):
    """`split` (a name, or a slice of it) of local data files, each checked first."""
    builder = data_file_builder(files[0].name)
    lines: list[tuple[Path, list[int]]] = []  # where each record of a jsonl file starts
    for path in files:
        if path.stat().st_size == 0:
            raise DataError(str(path), "is empty", "write at least one record, or remove "
                            "the file")
        if path.suffix.lower() == ".jsonl":
            lines.append((path, check_jsonl(path)))
        elif builder != "parquet":
            check_text(path)
    try:
        records = datasets.load_dataset(
            builder, data_files={split.split("[")[0]: [str(p) for p in files]}, split=split)
    except Exception as error:
        if "corresponds to no data" in str(error):  # datasets' words for zero records
            raise DataError(str(files[0]) if len(files) == 1 else source.uri, "holds no "
                            "records", "write at least one record") from error
        raise DataError(str(files[0]), f"cannot be read as {builder} ({_root_cause(error)})",
                        f"check that it is a valid {files[0].suffix.lstrip('.')} file") from error
    where = source.uri if len(files) > 1 else str(files[0])
    check_records(records, _format_of(source, records, where),
                  _locator(where, lines, len(records)), _written(lines, len(records)))
    return records


def _said(where: str, split: str, files: list[Path] | None = None) -> str:
    """A split's source for the log: one file whole is just its path."""
    if not files:
        return where if split == "train" else f"{where} split {split}"
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    shown = ", ".join(str(f.relative_to(where)) for f in files[:3])
    return f"{where} split {split} ({shown}{more})"


def local_split_files(source: DatasetSource, base_dir: Path | None = None,
                      evaluation: bool = False) -> tuple[list[Path], str]:
    """The files of a local dataset's split that is trained on (`evaluation`: evalSplit),
    and the split to read of them (the name, or a slice: `train[:95%]`)."""
    split = source.eval_split if evaluation else source.split
    name = split.split("[")[0]
    files, root = local_data_files(source.uri, base_dir), _local_path(source.uri, base_dir)
    if not root.is_dir():
        return files, _of_one_file(str(root), split, evaluation)
    splits = local_splits(files, root)
    if name not in splits:
        field = f"spec.dataset.{'evalSplit' if evaluation else 'split'}"
        others = [other for other in splits if not evaluation or other != source.split]
        fix = (f"set {field} to {' or '.join(others)}, or name the files by split "
               "(train.jsonl, validation.jsonl, test.jsonl)" if others else
               f"add {name} files beside the others (e.g. {name}.jsonl), or hold out part "
               "of the training split with evalFraction instead of evalSplit")
        raise DataError(str(root), f"has no {name} split ({_show_splits(splits, root)})", fix)
    return splits[name], split


def _of_one_file(where: str, split: str, evaluation: bool) -> str:
    """What to read of one file: it is split `train`, whole or a slice of it (`train[:90%]`),
    whatever other split `split` names (it trains on the whole file); evalSplit must be a
    slice of it."""
    name = split.split("[")[0]
    if name == "train":
        return split
    if evaluation:
        raise DataError(where, f"is one file (split train), with no {name} split to evaluate "
                        "on", f"point spec.dataset.uri at a folder of train and {name} files "
                        f"(e.g. train.jsonl, {name}.jsonl), evaluate on a slice of this one "
                        "(split: train[:95%], evalSplit: train[95%:]), or use evalFraction")
    return "train"


def _format_of(source: DatasetSource, records, where: str) -> str:
    try:
        return resolve_format(source.format, records.column_names)
    except DataError as error:
        raise DataError(where, error.what, error.fix) from None


def _locator(where: str, lines: list[tuple[Path, list[int]]], count: int):
    """Record index → `file:line` for JSON Lines (records in file order), else `where`
    with the record's number."""
    starts = [(path, number) for path, numbers in lines for number in numbers]
    if len(starts) == count:
        return lambda index: f"{starts[index][0]}:{starts[index][1]}"
    return lambda index: f"{where} record {index + 1}"


def _written(lines: list[tuple[Path, list[int]]], count: int):
    """Record index → the record as its JSON Lines file holds it, read again (only for a
    refused record), or None where the records are not the files' lines in order."""
    starts = [(path, number) for path, numbers in lines for number in numbers]

    def record(index: int) -> dict[str, Any] | None:
        if len(starts) != count:
            return None
        path, wanted = starts[index]
        return next((json.loads(line) for number, line in _text_lines(path)
                     if number == wanted), None)
    return record


# --- formats -----------------------------------------------------------------------------

FORMAT_COLUMNS: dict[str, list[set[str]]] = {
    "preference": [{"prompt", "chosen", "rejected"}],
    "chat": [{"messages"}],
    "instruction": [{"prompt", "response"}, {"instruction", "output"},
                    {"prompt", "completion"}],
    "text": [{"text"}],
    "prompt": [{"prompt"}],
}
"""Each format's columns, in the order `auto` tries them: a `prompt` alone (and any other
columns, handed to GRPO's reward functions) is the last resort."""


def resolve_format(requested: DatasetFormat, columns: Sequence[str]) -> str:
    """The concrete format, checking the columns it needs are there."""
    present = set(columns)
    if requested == "auto":
        for fmt, alternatives in FORMAT_COLUMNS.items():
            if fmt == "prompt" and present & {"chosen", "rejected"}:
                continue  # half a preference pair, not prompts
            if any(needed <= present for needed in alternatives):
                return fmt
        raise DataError("dataset", f"has columns {sorted(present)}, which match no format",
                        "provide `messages` (chat), `prompt`+`response`, "
                        "`prompt`+`completion` or `instruction`+`output` (instruction), "
                        "`text`, "
                        "`prompt`+`chosen`+`rejected` (preference, for objective dpo), or "
                        "`prompt` (prompt, for objective grpo)")
    if not any(needed <= present for needed in FORMAT_COLUMNS[requested]):
        wanted = " or ".join("+".join(sorted(n)) for n in FORMAT_COLUMNS[requested])
        closest = min(FORMAT_COLUMNS[requested], key=lambda needed: len(needed - present))
        fix = f"add {' and '.join(sorted(closest - present))} to every record, or rename the " \
              "columns that hold them"
        if requested not in OBJECTIVE_FORMATS:  # DPO's and GRPO's data have one format
            fix += ", or set spec.dataset.format to the data's format"
        raise DataError("dataset", f"format {requested} needs columns {wanted}, found "
                        f"{sorted(present)}", fix)
    return requested


OBJECTIVE_FORMATS = ("preference", "prompt")
"""The formats an objective trains on alone (DPO, GRPO): their data has no other."""


CHAT_FIX = ('write each conversation as "messages": [{"role": "user", "content": "..."}, '
            '{"role": "assistant", "content": "..."}], or remove that record')


def _describe(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "null"
    kind = ("text" if isinstance(value, str) else "true/false" if isinstance(value, bool)
            else "a number" if isinstance(value, (int, float)) else "a list"
            if isinstance(value, (list, tuple)) else "an object" if isinstance(value, dict)
            else "binary data" if isinstance(value, bytes) else type(value).__name__)
    preview = json.dumps(value, default=str, ensure_ascii=False)
    return f"{kind} {preview[:40]}{'...' if len(preview) > 40 else ''}"


def _is_text(value: Any) -> bool:
    """Text, or a number or boolean (CSV columns of digits are read as numbers)."""
    if isinstance(value, float):
        return not math.isnan(value)
    return isinstance(value, (str, int))


PREFERENCE_FIX = ('write "prompt", "chosen" and "rejected" as non-empty text, or each as '
                  'chat messages ("prompt": [{"role": "user", ...}], "chosen": [{"role": '
                  '"assistant", ...}]), or remove that record')


def _preference_problem(record: dict[str, Any], as_written: bool) -> tuple[str, str] | None:
    sides = {side: record.get(side) for side in ("prompt", "chosen", "rejected")}
    for side, value in sides.items():
        if as_written and side not in record:
            return f"has no `{side}`", PREFERENCE_FIX
        if not as_written and value is None:  # datasets fills a key a record lacks with None
            return f"has no `{side}` (missing or null)", PREFERENCE_FIX
    chat = [side for side, value in sides.items() if isinstance(value, list)]
    text = [side for side, value in sides.items() if _is_text(value)]
    if chat and text:
        return (f"mixes chat messages ({', '.join(chat)}) and text ({', '.join(text)})",
                PREFERENCE_FIX)
    for side, value in sides.items():
        if chat and not isinstance(value, list):
            return f"`{side}` is {_describe(value)}, not a list of messages", PREFERENCE_FIX
        if chat:
            if not value:
                return f"`{side}` is an empty list of messages", PREFERENCE_FIX
            problem = record_problem({"messages": value}, "chat")
            if problem is not None:
                return f"`{side}`: {problem[0]}", PREFERENCE_FIX
            roles = [m["role"] for m in value if m["role"] != "assistant"]
            if side != "prompt" and roles:
                return (f"`{side}` has a {roles[0]} message; the answers are assistant "
                        "turns", PREFERENCE_FIX)
        elif not _is_text(value):
            return f"`{side}` is {_describe(value)}, not text", PREFERENCE_FIX
        elif not str(value).strip():
            return f"`{side}` is empty", PREFERENCE_FIX
    return None


def record_problem(record: dict[str, Any], fmt: str, as_written: bool = False
                   ) -> tuple[str, str] | None:
    """What is wrong with one record for `fmt` (and the fix), or None. `as_written`: the
    record is as its file holds it (a JSON line), so a key it lacks is missing and a None
    was written `null`; a record read through datasets cannot tell the two apart."""
    if fmt == "preference":
        return _preference_problem(record, as_written)
    if fmt == "prompt":
        return _prompt_problem(record.get("prompt"))
    if fmt == "text":
        if not _is_text(record.get("text")):
            return (f"`text` is {_describe(record.get('text'))}, not text",
                    "write the sample as a string, or remove that record")
        return None
    if fmt == "instruction":
        if isinstance(record.get("prompt"), list) or isinstance(record.get("completion"), list):
            return _conversational_completion_problem(record)
        pairs = [p for p in INSTRUCTION_PAIRS if all(_is_text(record.get(field)) for field in p)]
        if not pairs:
            found = ", ".join(f"{k}: {_describe(v)}" for k, v in record.items())
            return ("has none of `prompt`+`response`, `prompt`+`completion` or "
                    f"`instruction`+`output` as text ({found})",
                    "fill in both fields of one pair, or remove that record")
        extra = record.get("input")
        if pairs[0][0] == "instruction" and extra is not None and not _is_text(extra):
            return (f"`input` is {_describe(extra)}, not text",
                    "write `input` as a string (or leave it out), or remove that record")
        return None
    return _messages_problem(record.get("messages"), "messages", CHAT_FIX)


INSTRUCTION_PAIRS = (("prompt", "response"), ("instruction", "output"), ("prompt", "completion"))
"""The instruction format's (prompt, answer) columns; `prompt`+`completion` is TRL's
prompt-completion layout."""

COMPLETION_FIX = ('write "prompt" and "completion" both as text, or both as chat messages '
                  '("prompt": [{"role": "user", ...}], "completion": [{"role": "assistant", '
                  '...}]), or remove that record')


PROMPT_FIX = ('write "prompt" as non-empty text, or as chat messages ("prompt": [{"role": '
              '"user", "content": "..."}]), or remove that record')


def _prompt_problem(prompt: Any) -> tuple[str, str] | None:
    """A prompt the model answers (GRPO): text, or a conversation that does not end with
    the model's own turn."""
    if isinstance(prompt, list):
        if (problem := _messages_problem(prompt, "prompt", PROMPT_FIX)) is not None:
            return problem
        if prompt[-1]["role"] == "assistant":
            return ("`prompt` ends with an assistant message; the model writes that turn",
                    PROMPT_FIX)
        return None
    if not _is_text(prompt):
        return f"`prompt` is {_describe(prompt)}, not text", PROMPT_FIX
    if not str(prompt).strip():
        return "`prompt` is empty", PROMPT_FIX
    return None


def _conversational_completion_problem(record: dict[str, Any]) -> tuple[str, str] | None:
    """TRL's conversational prompt-completion: the prompt's turns, then the completion's
    assistant turns (the ones trained on)."""
    for side in ("prompt", "completion"):
        if (problem := _messages_problem(record.get(side), side, COMPLETION_FIX)) is not None:
            return problem
    if not any(m.get("role") == "assistant" for m in record["completion"]):
        return "`completion` has no assistant turn to train on", COMPLETION_FIX
    return None


def _messages_problem(messages: Any, column: str, fix: str) -> tuple[str, str] | None:
    if not isinstance(messages, list):
        return f"`{column}` is {_describe(messages)}, not a list of messages", fix
    if not messages:
        return f"`{column}` is an empty conversation", fix
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            return f"message {number} is {_describe(message)}, not a {{role, content}} object", \
                fix
        if not isinstance(message.get("role"), str):
            return f"message {number} has role {_describe(message.get('role'))}", fix
        content = message.get("content")
        if not isinstance(content, str):
            parts = (" (content parts, as multimodal chats have, are not supported)"
                     if isinstance(content, list) else "")
            return (f"message {number} ({message['role']}) has content "
                    f"{_describe(content)}, not text{parts}", fix)
    return None


def check_records(records, fmt: str, locate, as_written=None) -> None:
    """Refuse the first record `fmt` cannot use; `locate(index)` says where it is, and
    `as_written(index)`, where given, what its file holds (None where it cannot say)."""
    wanted = {"chat": ["messages"], "text": ["text"],
              "preference": ["prompt", "chosen", "rejected"], "prompt": ["prompt"],
              "instruction": ["prompt", "response", "instruction", "input", "output",
                              "completion"]}[fmt]
    columns = [c for c in wanted if c in records.column_names]
    for index, record in enumerate(records.select_columns(columns)):
        if (problem := record_problem(record, fmt)) is not None:
            written = as_written(index) if as_written is not None else None
            if written is not None:  # said as the file has it: "has no `x`" or "is null"
                problem = record_problem({c: written[c] for c in columns if c in written},
                                         fmt, as_written=True) or problem
            raise DataError(locate(index), *problem)


def _chat_tokens(messages: list[dict[str, Any]], tokenizer, first_trained: int = 0
                 ) -> tuple[list[int], list[int]]:
    """Token ids of a conversation, labelled only on the assistant turns (from turn
    `first_trained` on: a prompt-completion record's completion).

    Each assistant turn's tokens are those the template adds when the turn is appended
    to the conversation so far (rendered with the generation prompt), so the role header
    is not trained on but the end-of-turn marker is. An assistant turn that opens the
    conversation answers nothing and is not trained on (templates cannot render the empty
    conversation before it).
    """
    def render(turns: list[dict[str, Any]], prompt: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False,
                                                  add_generation_prompt=prompt))

    ids = render(messages, prompt=False)
    labels = [IGNORE] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant" or i == 0 or i < first_trained:
            continue
        before, through = render(messages[:i], prompt=True), render(messages[: i + 1], False)
        start, end = len(before), len(through)
        if ids[:start] != before or ids[:end] != through:
            raise DataError("tokenizer.chat_template", "renders a conversation differently "
                            "from its prefixes, so assistant turns cannot be located",
                            "use a prefix-stable chat template, or format text")
        labels[start:end] = ids[start:end]
    return ids, labels


def _instruction_text(record: dict[str, Any]) -> tuple[str, str]:
    for answer in ("response", "completion"):
        if record.get("prompt") is not None and record.get(answer) is not None:
            return str(record["prompt"]), str(record[answer])
    extra = record.get("input") or ""
    prompt = ALPACA_PROMPT.format(instruction=record["instruction"],
                                  input_block=f"### Input:\n{extra}\n\n" if extra else "")
    return prompt, str(record["output"])


def tokenize_record(record: dict[str, Any], fmt: str, tokenizer, max_length: int
                    ) -> dict[str, list[int]]:
    """One sample's `input_ids` and `labels`, truncated to `max_length`."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id]
    if fmt == "chat":
        ids, labels = _chat_tokens(record["messages"], tokenizer)
    elif fmt == "instruction" and isinstance(record.get("prompt"), list):
        ids, labels = _chat_tokens(record["prompt"] + record["completion"], tokenizer,
                                   first_trained=len(record["prompt"]))
    elif fmt == "instruction":
        prompt, response = _instruction_text(record)
        prompt_ids = bos + tokenizer.encode(prompt, add_special_tokens=False)
        response_ids = tokenizer.encode(response, add_special_tokens=False) + eos
        ids = prompt_ids + response_ids
        labels = [IGNORE] * len(prompt_ids) + response_ids
    else:
        ids = bos + tokenizer.encode(str(record["text"]), add_special_tokens=False) + eos
        labels = list(ids)
    ids, labels = ids[:max_length], labels[:max_length]
    if labels:
        labels[0] = IGNORE  # nothing predicts a sample's first token
    return {"input_ids": ids, "labels": labels}


def tokenize_records(records, fmt: str, tokenizer, max_length: int) -> list[dict[str, list[int]]]:
    """Tokenise every record, dropping those truncation left without a trained token.

    A record the tokenizer or its chat template refuses (jinja's `raise_exception`, e.g.
    roles that do not alternate) is a DataError quoting the record."""
    out = []
    for record in records:
        problem = record_problem(record, fmt)
        try:
            if problem is not None:
                raise DataError("dataset record", *problem)
            sample = tokenize_record(record, fmt, tokenizer, max_length)
        except DataError:
            raise
        except (TemplateError, ValueError, TypeError, KeyError, IndexError) as error:
            raise DataError("dataset record", f"cannot be tokenized ({_root_cause(error)}): "
                            f"{_describe(dict(record))}", "fix the record so the tokenizer's "
                            "chat template accepts it, or remove it") from error
        if any(label != IGNORE for label in sample["labels"]):
            out.append(sample)
    return out


# --- preference pairs --------------------------------------------------------------------

def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _with_bos(ids: list[int], tokenizer) -> list[int]:
    """`ids` starting with the BOS token where the tokenizer has one and did not add it
    (as `tokenize_record` starts every sample)."""
    bos = tokenizer.bos_token_id
    return ids if bos is None or ids[:1] == [bos] else [bos, *ids]


def pair_tokens(record: dict[str, Any], tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) token ids of one preference record, as TRL's DPOTrainer
    makes them: the prompt alone (chat: with the generation prompt) and the prompt joined
    with each answer (text: ending in EOS) are tokenised, and each answer is what follows
    the longest prefix all three share, so a token merged across the boundary is the
    answer's."""
    if isinstance(record["prompt"], list):
        def render(messages: list[dict[str, Any]], prompt: bool = False) -> list[int]:
            return list(tokenizer.apply_chat_template(messages, tokenize=True,
                                                      return_dict=False,
                                                      add_generation_prompt=prompt))
        prompt = render(record["prompt"], prompt=True)
        chosen = render(record["prompt"] + record["chosen"])
        rejected = render(record["prompt"] + record["rejected"])
    else:
        text, eos = str(record["prompt"]), tokenizer.eos_token

        def encode(value: str) -> list[int]:
            return _with_bos(tokenizer(value)["input_ids"], tokenizer)

        def answer(value: Any) -> str:
            value = str(value)
            return value if value.endswith(eos) else value + eos
        prompt = encode(text)
        chosen = encode(text + answer(record["chosen"]))
        rejected = encode(text + answer(record["rejected"]))
    shared = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
    if shared == 0:  # an answer's first token would be predicted from outside its side
        raise DataError("dataset record", "its prompt shares no token with its answers once "
                        "tokenised (the tokenizer adds no BOS, and the prompt's last token "
                        f"merges into the answers): {_describe(dict(record))}",
                        "lengthen the prompt or end it on a word boundary, or remove it")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def truncated_pair(prompt: list[int], chosen: list[int], rejected: list[int],
                   max_length: int) -> tuple[list[int], list[int], list[int]]:
    """The pair cut so prompt + each answer fits `max_length`: the answers kept whole and
    the prompt's start dropped while the prompt keeps at least half the room; beyond that
    the answers lose their ends too."""
    longest = max(len(chosen), len(rejected))
    if len(prompt) + longest <= max_length:
        return prompt, chosen, rejected
    keep = max(max_length - longest, min(len(prompt), max_length // 2))
    room = max_length - keep
    return prompt[len(prompt) - keep:], chosen[:room], rejected[:room]


def pair_sample(prompt: list[int], chosen: list[int], rejected: list[int]
                ) -> dict[str, list[int]]:
    """One pair as the model reads it: prompt + chosen, then prompt + rejected, positions
    restarting at the second (so neither attends to the other), labels on the answers;
    `answers` says which answer each token belongs to (0 chosen, 1 rejected, -1 none)."""
    ids, labels, positions, answers = [], [], [], []
    for side, answer in enumerate((chosen, rejected)):
        ids += prompt + answer
        labels += [IGNORE] * len(prompt) + answer
        positions += list(range(len(prompt) + len(answer)))
        answers += [-1] * len(prompt) + [side] * len(answer)
    return {"input_ids": ids, "labels": labels, "position_ids": positions,
            "answers": answers, "pairs": [0]}


@dataclass
class Pairs:
    """Tokenised preference pairs, and how many truncation cut."""

    samples: list[dict[str, list[int]]]
    truncated: int = 0

    def said(self, max_length: int) -> str | None:
        if not self.truncated:
            return None
        return (f"truncated {self.truncated} of {len(self.samples)} preference pairs to "
                f"maxSeqLength {max_length} tokens a side (kept the answers and the end of "
                "each prompt; raise spec.dataset.maxSeqLength to keep them whole)")


def tokenize_pairs(records, tokenizer, max_length: int, first_id: int = 0) -> Pairs:
    """Every preference record as a pair sample (`pair_sample`), numbered from `first_id`
    in `pairs`; a record the tokenizer refuses is a DataError quoting it."""
    out = Pairs([])
    for record in records:
        if (problem := record_problem(record, "preference")) is not None:
            raise DataError("dataset record", *problem)
        try:
            prompt, chosen, rejected = pair_tokens(record, tokenizer)
        except (TemplateError, ValueError, TypeError, KeyError, IndexError) as error:
            raise DataError("dataset record", f"cannot be tokenized ({_root_cause(error)}): "
                            f"{_describe(dict(record))}", "fix the record so the tokenizer's "
                            "chat template accepts it, or remove it") from error
        if not chosen or not rejected:
            side = "chosen" if not chosen else "rejected"
            raise DataError("dataset record", f"its {side} answer adds no token to the "
                            f"prompt: {_describe(dict(record))}", PREFERENCE_FIX)
        cut = truncated_pair(prompt, chosen, rejected, max_length)
        out.truncated += cut != (prompt, chosen, rejected)
        sample = pair_sample(*cut)
        sample["pairs"] = [first_id + len(out.samples)]
        out.samples.append(sample)
    return out


# --- sequences ---------------------------------------------------------------------------

def _sequence(samples: list[dict[str, list[int]]]) -> dict[str, list[int]]:
    """Samples joined into one sequence; preference pairs keep their own positions, and
    their `answers` are numbered within the sequence (pair k's are 2k and 2k + 1)."""
    seq: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    paired = bool(samples) and "pairs" in samples[0]
    if paired:
        seq["answers"], seq["pairs"] = [], []
    for sample in samples:
        seq["input_ids"] += sample["input_ids"]
        seq["labels"] += sample["labels"]
        seq["position_ids"] += sample.get("position_ids") or list(range(len(sample["input_ids"])))
        if paired:
            offset = 2 * len(seq["pairs"])
            seq["answers"] += [a if a < 0 else a + offset for a in sample["answers"]]
            seq["pairs"] += sample["pairs"]
    return seq


def pack(samples: list[dict[str, list[int]]], max_length: int) -> list[dict[str, list[int]]]:
    """Samples in as few sequences of at most `max_length` tokens as best-fit decreasing
    finds: longest first, each into the open sequence with the least room that fits it.

    On long-tailed instruction data the sequences come out >99% full, where joining
    consecutive samples (`pack_in_order`) left ~18% of them empty, to be padded and
    computed for nothing. The batches shuffle the sequences every epoch.
    """
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]["input_ids"]))
    rooms = _OpenRooms(max_length)
    members: list[list[int]] = []
    for index in order:
        size = len(samples[index]["input_ids"])
        found = rooms.take(size)
        if found is None:
            members.append([index])
            rooms.add(max_length - size, len(members) - 1)
        else:
            sequence, room = found
            members[sequence].append(index)
            rooms.add(room - size, sequence)
    return [_sequence([samples[i] for i in indices]) for indices in members]


class _OpenRooms:
    """The free room of the open sequences, with the smallest room of at least `size`
    found in O(log max_length): a max-tree over the possible amounts of room."""

    def __init__(self, max_length: int) -> None:
        self.leaves = 1 << max_length.bit_length()  # one leaf per amount, 0..max_length
        self.tree = [0] * (2 * self.leaves)
        """At each node, the largest room held by a sequence under it (0: none)."""
        self.holders: dict[int, list[int]] = {}

    def add(self, room: int, sequence: int) -> None:
        if room <= 0:
            return  # full: nothing else fits
        self.holders.setdefault(room, []).append(sequence)
        self._set(room, room)

    def take(self, size: int) -> tuple[int, int] | None:
        """(sequence, its room) with the least room >= `size`, no longer open; else None."""
        if self.tree[1] < size:
            return None
        node = 1
        while node < self.leaves:
            node = 2 * node if self.tree[2 * node] >= size else 2 * node + 1
        room = node - self.leaves
        holders = self.holders[room]
        sequence = holders.pop()
        if not holders:
            del self.holders[room]
            self._set(room, 0)
        return sequence, room

    def _set(self, room: int, value: int) -> None:
        node = room + self.leaves
        self.tree[node] = value
        node //= 2
        while node:
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
            node //= 2


def pack_in_order(samples: list[dict[str, list[int]]],
                  max_length: int) -> list[dict[str, list[int]]]:
    """Consecutive samples joined into sequences of at most `max_length` tokens (next-fit):
    the packing `pack` replaced, kept as the benchmark's other side."""
    sequences, current, used = [], [], 0
    for sample in samples:
        size = len(sample["input_ids"])
        if current and used + size > max_length:
            sequences.append(_sequence(current))
            current, used = [], 0
        current.append(sample)
        used += size
    if current:
        sequences.append(_sequence(current))
    return sequences


def one_per_sequence(samples: list[dict[str, list[int]]]) -> list[dict[str, list[int]]]:
    return [_sequence([sample]) for sample in samples]


def label_tokens(sequence: dict[str, list[int]]) -> int:
    """Tokens that carry loss: what tokens/s counts."""
    return sum(label != IGNORE for label in sequence["labels"])


# --- batches -----------------------------------------------------------------------------

@dataclass(frozen=True)
class GlobalBatches:
    """Which sequences each rank reads at each step, identical on every rank.

    An optimizer step consumes one global batch of `micro_batch x accumulation x world`
    sequences in a seeded per-epoch order; micro-step `a` of rank `r` reads slot
    `a * world + r`. So 2 ranks with accumulation 1 train on the same sequences per step
    as 1 rank with accumulation 2, and each sequence is read exactly once per epoch (the
    last step of an epoch may be short; ranks with nothing left get empty micro-batches).
    """

    num_sequences: int
    micro_batch: int
    accumulation: int
    world_size: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_sequences / self.global_batch)

    def order(self, epoch: int) -> list[int]:
        order = list(range(self.num_sequences))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _order(self, epoch: int) -> list[int]:
        """`order`, shuffled once per epoch rather than once per step."""
        cached = self.__dict__.get("_cached_order")
        if cached is None or cached[0] != epoch:
            cached = (epoch, self.order(epoch))
            object.__setattr__(self, "_cached_order", cached)
        return cached[1]

    def step_indices(self, epoch: int, step: int) -> list[int]:
        """Every sequence of the global batch at `step` (0-based) of `epoch`, all ranks."""
        return self._order(epoch)[step * self.global_batch:(step + 1) * self.global_batch]

    def micro_batches(self, epoch: int, step: int, rank: int) -> list[list[int]]:
        """Sequence indices of each micro-step of `rank` at `step` (0-based) of `epoch`."""
        window = self.step_indices(epoch, step)
        out = []
        for micro in range(self.accumulation):
            slot = micro * self.world_size + rank
            out.append(window[slot * self.micro_batch:(slot + 1) * self.micro_batch])
        return out

    def idle_ranks(self) -> int:
        """Ranks that read nothing at any step: the data ends before their first slot."""
        return max(0, self.world_size - math.ceil(self.num_sequences / self.micro_batch))

    def schedule(self, start_step: int = 0) -> Iterator[tuple[int, int]]:
        """(epoch, step within epoch) for every optimizer step from `start_step` on."""
        step = start_step
        while True:
            yield divmod(step, self.steps_per_epoch)
            step += 1


def rank_batches(sequences: list, micro_batch: int, world: int, rank: int) -> Iterator[list]:
    """`rank`'s micro-batches of a pass over `sequences` in order (evaluation, the DPO
    reference): every rank gets the same number, the last ones possibly empty, so
    collectives inside the forward stay in step."""
    for start in range(0, len(sequences), micro_batch * world):
        yield sequences[start + rank * micro_batch: start + (rank + 1) * micro_batch]


def batch_larger_than_data(batches: GlobalBatches, per_device: int, accumulation: int,
                           packed: bool) -> str | None:
    """A warning when one step's batch holds more sequences than the data has: every step
    then trains on all of it (an epoch a step), and processes past its end only wait."""
    sequences, world = batches.num_sequences, batches.world_size
    if sequences >= batches.global_batch:
        return None
    plural = "es" if world > 1 else ""
    said = (f"warning: the data is {sequences} sequence{'s' if sequences != 1 else ''}"
            f"{' after packing' if packed else ''}, fewer than one step's batch of "
            f"{batches.global_batch} (batchSizePerDevice {per_device} x "
            f"gradientAccumulationSteps {accumulation} x {world} process{plural}): every step "
            "trains on all of it")
    if idle := batches.idle_ranks():
        said += f", and {idle} of the {world} process{plural} get{'s' if idle == 1 else ''} none"
    if sequences >= accumulation * world:
        fix = f"set hyperparameters.batchSizePerDevice to {sequences // (accumulation * world)}"
    elif sequences >= world:
        fix = ("set hyperparameters.batchSizePerDevice to "
               f"{sequences // world} and gradientAccumulationSteps to 1")
    else:
        fix = f"run on {sequences} process{'es' if sequences > 1 else ''} or fewer"
    return f"{said} — {fix}, or add data"


class Prefetched:
    """(key, make(key)) for each key, made `ahead` items in advance on a daemon thread: the
    next steps' batches are collated (and pinned) while this step computes. An error in
    `make` is raised where its item is read."""

    def __init__(self, keys: Iterable, make: Callable, ahead: int = 2) -> None:
        self._made: queue.Queue = queue.Queue(maxsize=max(ahead, 1))
        threading.Thread(target=self._fill, args=(iter(keys), make), daemon=True,
                         name="prefetch-batches").start()

    def _fill(self, keys: Iterator, make: Callable) -> None:
        for key in keys:
            try:
                self._made.put((key, make(key), None))
            except BaseException as error:  # handed to the reader, not lost in a thread
                self._made.put((key, None, error))
                return

    def __iter__(self) -> Prefetched:
        return self

    def __next__(self):
        key, value, error = self._made.get()
        if error is not None:
            raise error
        return key, value


def collate(sequences: list[dict[str, list[int]]], pad_id: int, width: int | None = None,
            paired: bool = False, rows: int | None = None):
    """Tensors for one micro-batch, right-padded to its longest sequence (or to `width`
    when that is longer), and to `rows` rows with padding rows where it holds fewer.

    Padding restarts position_ids at 0, so it forms its own segment and never attends to
    or from real tokens. An empty micro-batch becomes one padding row with no loss: the
    rank still runs forward and backward, keeping collectives in step with its peers.
    """
    empty = {"input_ids": [pad_id], "labels": [IGNORE], "position_ids": [0],
             **({"answers": [-1], "pairs": []} if paired else {})}
    sequences = list(sequences) + [empty] * max((rows or 1) - len(sequences), 0)
    width = max(width or 0, *(len(s["input_ids"]) for s in sequences))

    def padded(key: str, fill: int, continue_positions: bool = False) -> torch.Tensor:
        rows = []
        for s in sequences:
            gap = width - len(s[key])
            tail = list(range(gap)) if continue_positions else [fill] * gap
            rows.append(s[key] + tail)
        return torch.tensor(rows, dtype=torch.long)

    batch = {"input_ids": padded("input_ids", pad_id), "labels": padded("labels", IGNORE),
             "position_ids": padded("position_ids", 0, continue_positions=True)}
    if "pairs" in sequences[0]:  # preference pairs: answers numbered across the batch
        rows, before = [], 0
        for s in sequences:
            rows.append([a if a < 0 else a + 2 * before for a in s["answers"]]
                        + [-1] * (width - len(s["answers"])))
            before += len(s["pairs"])
        batch["answers"] = torch.tensor(rows, dtype=torch.long)
        batch["pairs"] = torch.tensor([p for s in sequences for p in s["pairs"]],
                                      dtype=torch.long)
    return batch
