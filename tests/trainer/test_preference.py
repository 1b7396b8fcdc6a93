"""Preference tuning (`objective.type: dpo`): each pair tokenised as TRL's DPOTrainer makes
it, cut to fit maxSeqLength, packed without one answer seeing the other, each answer's
log-probability summed, and the DPO losses and rewards over them."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
import torch.nn.functional as F

from finetune_trainer import loss
from finetune_trainer.config import DatasetSource, TrainerConfig
from finetune_trainer.data import (
    IGNORE,
    DataError,
    Pairs,
    collate,
    one_per_sequence,
    pack,
    pack_in_order,
    pair_sample,
    pair_tokens,
    read_split,
    tokenize_pairs,
    truncated_pair,
)
from finetune_trainer.objectives import spec_of
from finetune_trainer.objectives.base import RunContext
from finetune_trainer.objectives.dpo.loss import answer_lengths, dpo_losses
from finetune_trainer.objectives.dpo.settings import DpoConfig
from tests.conftest import REPO

PREFERENCES = REPO / "examples/data/tiny-preferences.jsonl"
CHAT_PAIR = {"prompt": [{"role": "user", "content": "What is a GPU?"}],
             "chosen": [{"role": "assistant", "content": "A parallel processor."}],
             "rejected": [{"role": "assistant", "content": "No idea."}]}
TEXT_PAIR = {"prompt": "Q: What is a GPU? A:", "chosen": " A parallel processor.",
             "rejected": " No idea."}


def shipped(count: int | None = None) -> list[dict]:
    lines = PREFERENCES.read_text().splitlines()
    return [json.loads(line) for line in lines[:count]]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- tokens of a pair ----------------------------------------------------------------------

def test_a_chat_pair_shares_the_prompt_and_its_answers_end_in_the_end_marker(tiny_tokenizer):
    prompt, chosen, rejected = pair_tokens(CHAT_PAIR, tiny_tokenizer)
    decode = tiny_tokenizer.decode
    # the prompt is the conversation and the generation prompt; the answers what follows
    assert decode(prompt) == "<|begin|><|user|>\nWhat is a GPU?<|end|>\n<|assistant|>\n"
    assert decode(chosen) == "A parallel processor.<|end|>\n"
    assert decode(rejected) == "No idea.<|end|>\n"
    for answer, side in ((chosen, "chosen"), (rejected, "rejected")):
        whole = tiny_tokenizer.apply_chat_template(CHAT_PAIR["prompt"] + CHAT_PAIR[side],
                                                   tokenize=True, return_dict=False)
        assert prompt + answer == list(whole)


def test_a_text_pair_starts_with_bos_and_its_answers_end_in_eos(tiny_tokenizer):
    prompt, chosen, rejected = pair_tokens(TEXT_PAIR, tiny_tokenizer)
    bos, eos = tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_id
    assert prompt == [bos, *tiny_tokenizer(TEXT_PAIR["prompt"])["input_ids"]]
    assert chosen[-1] == eos and rejected[-1] == eos
    assert tiny_tokenizer.decode(chosen) == " A parallel processor.<|end|>"
    assert tiny_tokenizer.decode(rejected) == " No idea.<|end|>"
    assert prompt + chosen == [bos, *tiny_tokenizer(
        TEXT_PAIR["prompt"] + TEXT_PAIR["chosen"] + "<|end|>")["input_ids"]]
    # an answer that already ends in EOS gets no second one
    ended = {**TEXT_PAIR, "chosen": TEXT_PAIR["chosen"] + "<|end|>"}
    assert pair_tokens(ended, tiny_tokenizer)[1] == chosen


def test_a_token_merged_across_the_boundary_is_the_answers(tiny_tokenizer):
    """`What is a GP` + `U?`: the prompt alone ends in ` GP`, prompt + answer has ` GPU`;
    the answer starts where the token ids part."""
    record = {"prompt": "What is a GP", "chosen": "U?", "rejected": "S?"}
    prompt, chosen, rejected = pair_tokens(record, tiny_tokenizer)
    alone = tiny_tokenizer("What is a GP")["input_ids"]
    assert prompt == [tiny_tokenizer.bos_token_id, *alone[:-1]]  # ` GP` left to the answers
    assert tiny_tokenizer.decode(chosen) == " GPU?<|end|>"
    assert tiny_tokenizer.decode(rejected) == " GPS?<|end|>"
    assert prompt + chosen == [tiny_tokenizer.bos_token_id,
                               *tiny_tokenizer("What is a GPU?<|end|>")["input_ids"]]


def _trl_tokenized(records: list[dict], tokenizer) -> list[tuple[list, list, list]]:
    """What TRL 1.16's DPOTrainer makes of the records (its own `_prepare_dataset`: EOS
    added to text answers, the tokenisation, the common prefix), in this process."""
    import datasets
    from trl import DPOConfig
    from trl.trainer.dpo_trainer import DPOTrainer

    args = DPOConfig(output_dir="unused", report_to=[], bf16=False, use_cpu=True)
    trainer = types.SimpleNamespace(_tokenizer=tokenizer)  # all the method reads of self
    prepared = DPOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(records),
                                           tokenizer, args, "train")
    return [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in prepared]


def test_pairs_are_tokenised_as_trls_dpo_trainer_tokenises_them(tiny_tokenizer):
    import trl

    assert trl.__version__.startswith("1.16")
    records = shipped()
    ours = [pair_tokens(record, tiny_tokenizer) for record in records]
    assert ours == _trl_tokenized(records, tiny_tokenizer)
    # text: the same answers; the prompt starts with BOS, as every sample of the trainer
    # does, where TRL leaves it to the tokenizer (this one adds none)
    [(prompt, chosen, rejected)] = _trl_tokenized([TEXT_PAIR], tiny_tokenizer)
    assert pair_tokens(TEXT_PAIR, tiny_tokenizer) == (
        [tiny_tokenizer.bos_token_id, *prompt], chosen, rejected)


# --- truncation ----------------------------------------------------------------------------

def test_a_pair_that_fits_is_left_whole():
    pair = ([1, 2, 3, 4, 5, 6], [7, 8], [9])
    assert truncated_pair(*pair, max_length=8) == pair


def test_truncation_keeps_the_answers_and_the_end_of_the_prompt():
    # the longer answer (2) and 6 of the prompt: its first two tokens go
    assert truncated_pair([1, 2, 3, 4, 5, 6], [7, 8], [9], max_length=6) == (
        [3, 4, 5, 6], [7, 8], [9])
    # the prompt keeps half the room at least, so the long answer loses its end; the
    # short one fits what is left
    assert truncated_pair(list(range(1, 11)), list(range(11, 19)), [19], max_length=8) == (
        [7, 8, 9, 10], [11, 12, 13, 14], [19])
    # a short prompt is kept whole, the answers get the rest
    assert truncated_pair([1, 2], list(range(11, 19)), [19], max_length=8) == (
        [1, 2], [11, 12, 13, 14, 15, 16], [19])


def test_tokenize_pairs_counts_and_says_what_truncation_cut(tiny_tokenizer):
    long = {"prompt": "What is warmup? " * 20, "chosen": " Slow start.", "rejected": " Fast."}
    short = {"prompt": "Q: hi? A:", "chosen": " yes", "rejected": " no"}
    pairs = tokenize_pairs([long, short], tiny_tokenizer, max_length=16)
    assert isinstance(pairs, Pairs) and pairs.truncated == 1
    assert pairs.said(16) == (
        "truncated 1 of 2 preference pairs to maxSeqLength 16 tokens a side (kept the answers "
        "and the end of each prompt; raise spec.dataset.maxSeqLength to keep them whole)")
    cut = pairs.samples[0]
    chosen = [t for t, a in zip(cut["input_ids"], cut["answers"], strict=True) if a == 0]
    assert tiny_tokenizer.decode(chosen) == " Slow start.<|end|>"  # the answer whole
    assert cut["position_ids"].count(0) == 2 and max(cut["position_ids"]) < 16
    assert tokenize_pairs([long], tiny_tokenizer, max_length=512).said(512) is None


# --- samples, packing and batches ----------------------------------------------------------

def test_a_pair_sample_is_prompt_chosen_then_prompt_rejected_from_position_zero():
    assert pair_sample([1, 2, 3], [4, 5], [6]) == {
        "input_ids": [1, 2, 3, 4, 5, 1, 2, 3, 6],
        "labels": [IGNORE, IGNORE, IGNORE, 4, 5, IGNORE, IGNORE, IGNORE, 6],
        "position_ids": [0, 1, 2, 3, 4, 0, 1, 2, 3],
        "answers": [-1, -1, -1, 0, 0, -1, -1, -1, 1],
        "pairs": [0]}


def numbered(pid: int, prompt: list[int], chosen: list[int], rejected: list[int]) -> dict:
    sample = pair_sample(prompt, chosen, rejected)
    sample["pairs"] = [pid]
    return sample


PAIRS = [numbered(0, [1, 2], [3], [4, 4]),  # 7 tokens
         numbered(1, [5], [6, 6], [7]),  # 5 tokens
         numbered(2, [8, 8, 8], [9], [10])]  # 8 tokens


@pytest.mark.parametrize("packer", [pack, pack_in_order])
def test_packed_pairs_number_their_answers_in_the_sequence(packer):
    sequences = packer(PAIRS, max_length=13)
    joined = next(s for s in sequences if len(s["pairs"]) == 2)
    first, second = (PAIRS[p] for p in joined["pairs"])
    # the pairs' own positions: four segments, each from 0
    assert joined["position_ids"] == first["position_ids"] + second["position_ids"]
    assert joined["position_ids"].count(0) == 4
    # the first pair's answers 0 and 1, the second's 2 and 3, prompts -1
    assert joined["answers"] == first["answers"] + [a if a < 0 else a + 2
                                                    for a in second["answers"]]
    assert joined["input_ids"] == first["input_ids"] + second["input_ids"]
    assert joined["labels"] == first["labels"] + second["labels"]
    assert sorted(p for s in sequences for p in s["pairs"]) == [0, 1, 2]


def test_one_pair_a_sequence_keeps_its_numbers():
    sequences = one_per_sequence(PAIRS)
    assert [s["pairs"] for s in sequences] == [[0], [1], [2]]
    assert [set(s["answers"]) for s in sequences] == [{-1, 0, 1}] * 3


def test_collate_numbers_the_answers_across_the_rows_of_a_batch():
    row0 = one_per_sequence([PAIRS[2]])[0]
    row1 = pack_in_order(PAIRS[:2], max_length=13)[0]  # pairs 0 and 1, 12 tokens
    assert row1["pairs"] == [0, 1]
    batch = collate([row0, row1], pad_id=0, paired=True)
    assert batch["pairs"].tolist() == [2, 0, 1]  # pair k's answers are 2k and 2k + 1
    assert batch["answers"].tolist() == [
        [-1, -1, -1, 0, -1, -1, -1, 1, -1, -1, -1, -1],  # padding: no answer
        [-1, -1, 2, -1, -1, 3, 3, -1, 4, 4, -1, 5]]  # after row 0's pair: 2 to 5
    assert batch["position_ids"][1].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 0, 1]
    # each trained position: the token it predicts, and that token's answer
    targets = loss.answer_targets(batch["labels"], batch["answers"])
    assert targets["loss_rows"].tolist() == [2, 6, 13, 16, 17, 19, 20, 22]
    assert targets["loss_targets"].tolist() == [9, 10, 3, 4, 4, 6, 6, 7]
    assert targets["loss_answers"].tolist() == [0, 1, 2, 3, 3, 4, 4, 5]


def test_an_empty_micro_batch_of_pairs_trains_no_position():
    """A rank with nothing left at the end of an epoch (test_data.py: its collate)."""
    batch = collate([], pad_id=0, paired=True)
    targets = loss.answer_targets(batch["labels"], batch["answers"])
    assert targets["loss_rows"].numel() == targets["loss_answers"].numel() == 0


def test_shipped_pairs_packed_keep_every_answer_token_labelled_once(tiny_tokenizer):
    records = shipped()
    pairs = tokenize_pairs(records, tiny_tokenizer, max_length=64).samples
    sequences = pack(pairs, max_length=128)
    assert len(sequences) < len(pairs)
    assert sorted(p for s in sequences for p in s["pairs"]) == list(range(len(pairs)))
    for sequence in sequences:
        assert len(sequence["input_ids"]) <= 128
        answers, labels = sequence["answers"], sequence["labels"]
        # a label exactly where a token belongs to an answer, and every answer has some
        assert [a >= 0 for a in answers] == [label != IGNORE for label in labels]
        assert set(answers) - {-1} == set(range(2 * len(sequence["pairs"])))
        start = 0
        for k, pid in enumerate(sequence["pairs"]):  # each pair whole, in `pairs` order
            prompt, chosen, rejected = pair_tokens(records[pid], tiny_tokenizer)
            end = start + 2 * len(prompt) + len(chosen) + len(rejected)
            assert sequence["input_ids"][start:end] == prompt + chosen + prompt + rejected
            assert answers[start:end] == ([-1] * len(prompt) + [2 * k] * len(chosen)
                                          + [-1] * len(prompt) + [2 * k + 1] * len(rejected))
            start = end
        assert start == len(sequence["input_ids"])


# --- records the trainer refuses -----------------------------------------------------------

GOOD_TEXT = {"prompt": "Q: hi? A:", "chosen": " hello", "rejected": " go"}
GOOD_CHAT = CHAT_PAIR
USER = [{"role": "user", "content": "x"}]
ANSWER = [{"role": "assistant", "content": "y"}]

REFUSED = {
    "text-rejected-missing": ([GOOD_TEXT, {"prompt": "Q", "chosen": " a"}], 2,
                              "has no `rejected`"),
    "text-rejected-null": ([GOOD_TEXT, {"prompt": "Q", "chosen": " a", "rejected": None}], 2,
                           "`rejected` is null, not text"),
    "text-chosen-missing": ([GOOD_TEXT, GOOD_TEXT, {"prompt": "Q", "rejected": " b"}], 3,
                            "has no `chosen`"),
    "text-prompt-missing": ([GOOD_TEXT, {"chosen": " a", "rejected": " b"}], 2,
                            "has no `prompt`"),
    "text-chosen-empty": ([GOOD_TEXT, GOOD_TEXT, {"prompt": "Q", "chosen": "  ",
                                                  "rejected": " b"}], 3, "`chosen` is empty"),
    "text-prompt-empty": ([{"prompt": "", "chosen": " a", "rejected": " b"}], 1,
                          "`prompt` is empty"),
    "text-chosen-an-object": ([GOOD_TEXT, {"prompt": "Q", "chosen": {"a": 1},
                                           "rejected": " b"}], 2,
                              '`chosen` is an object {"a": 1}, not text'),
    "chat-prompt-and-text-answers": ([{"prompt": USER, "chosen": "y", "rejected": "z"}], 1,
                                     "mixes chat messages (prompt) and text (chosen, "
                                     "rejected)"),
    "chat-chosen-empty": ([GOOD_CHAT, {"prompt": USER, "chosen": [], "rejected": ANSWER}], 2,
                          "`chosen` is an empty list of messages"),
    "chat-answer-by-the-user": ([GOOD_CHAT, {"prompt": USER, "chosen": ANSWER,
                                             "rejected": [{"role": "user", "content": "y"}]}],
                                2, "`rejected` has a user message; the answers are assistant "
                                   "turns"),
    "chat-content-null": ([GOOD_CHAT, {"prompt": [{"role": "user", "content": None}],
                                       "chosen": ANSWER, "rejected": ANSWER}], 2,
                          "`prompt`: message 1 (user) has content null, not text"),
}


@pytest.mark.parametrize(("rows", "line", "what"), REFUSED.values(), ids=REFUSED.keys())
def test_a_record_that_is_no_pair_is_named_by_its_line(tmp_path, rows, line, what):
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DataError) as refused:
        read_split(DatasetSource(uri=str(path), format="preference"))
    assert (refused.value.where, refused.value.what) == (f"{path}:{line}", what)
    assert refused.value.fix.startswith('write "prompt", "chosen" and "rejected" as non-empty')


@pytest.mark.parametrize(("record", "said"), [
    ({"prompt": USER, "chosen": ANSWER, "rejected": None}, "`rejected` is null"),
    ({"prompt": USER, "chosen": ANSWER[0], "rejected": ANSWER}, "`chosen` is an object"),
    ({"prompt": USER, "chosen": ANSWER}, "has no `rejected`"),
], ids=["rejected-null", "chosen-one-message-object", "rejected-missing"])
def test_a_chat_pair_with_an_answer_that_is_no_list_says_what_it_is(tmp_path, record, said):
    path = write_jsonl(tmp_path / "pairs.jsonl", [GOOD_CHAT, record])
    with pytest.raises(DataError) as refused:
        read_split(DatasetSource(uri=str(path), format="preference"))
    assert refused.value.where == f"{path}:2"
    what = refused.value.what
    assert what.startswith(said), what
    assert "text (" not in what and "null" not in what.removeprefix(said), what


def test_a_pair_missing_an_answer_in_a_file_that_does_not_say_which_is_named_as_either(
        tmp_path):
    """A JSON array (or parquet, csv, a hub dataset) reaches the trainer through datasets,
    which fills a key one record lacks with null: the two are told apart only in JSON
    Lines, whose lines are read again."""
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps([GOOD_TEXT, {"prompt": "Q", "chosen": " a"}]))
    with pytest.raises(DataError) as refused:
        read_split(DatasetSource(uri=str(path), format="preference"))
    assert (refused.value.where, refused.value.what) == (
        f"{path} record 2", "has no `rejected` (missing or null)")


def test_no_answer_token_is_predicted_from_outside_its_own_side(tiny_model_dir):
    from transformers import AutoTokenizer

    without_bos = AutoTokenizer.from_pretrained(tiny_model_dir)  # not the shared fixture
    without_bos.bos_token = None
    record = {"prompt": "Wh", "chosen": "at is a GPU?", "rejected": "y?"}
    try:
        [sample] = tokenize_pairs([record], without_bos, max_length=64).samples
    except DataError:
        return  # refusing the pair is an answer too
    scored = [p for p, a in zip(sample["position_ids"], sample["answers"], strict=True)
              if a >= 0]
    assert min(scored) > 0, sample


def test_a_record_tokenize_pairs_is_handed_is_checked_too(tiny_tokenizer):
    with pytest.raises(DataError) as refused:
        tokenize_pairs([GOOD_TEXT, {"prompt": "Q", "chosen": "", "rejected": " b"}],
                       tiny_tokenizer, max_length=64)
    assert (refused.value.where, refused.value.what) == ("dataset record", "`chosen` is empty")


# --- the preflight -------------------------------------------------------------------------

def trainer_config(data, model, out, objective: str, fmt: str = "auto", **dataset):
    return TrainerConfig.model_validate({
        "job": {"name": "pairs"}, "model": {"uri": str(model)},
        "dataset": {"uri": str(data), "format": fmt, **dataset},
        "objective": {"type": objective}, "method": {"type": "lora"},
        "strategy": {"type": "ddp"}, "hyperparameters": {"maxSteps": 1},
        "output": {"uri": str(out)}})


def test_the_preflight_packs_pairs_and_numbers_the_eval_pairs_after_the_training_pairs(
        tiny_model_dir, tmp_path):
    from finetune_trainer.train import preflight

    config = trainer_config(PREFERENCES, tiny_model_dir, tmp_path / "out", "dpo",
                            maxSeqLength=64, evalFraction=0.25)
    prepared = preflight(config, tmp_path)
    train = [p for s in prepared.train for p in s["pairs"]]
    evaluation = [p for s in prepared.eval for p in s["pairs"]]
    assert (len(train), len(evaluation)) == (48, 16)
    assert sorted(train) == list(range(48)) and sorted(evaluation) == list(range(48, 64))
    assert len(prepared.train) < 48  # packed, two sides of 64 tokens to a row
    assert max(len(s["input_ids"]) for s in prepared.train + prepared.eval) <= 128
    assert prepared.notes == ()  # nothing truncated at 64 tokens a side

    short = trainer_config(PREFERENCES, tiny_model_dir, tmp_path / "out", "dpo",
                           maxSeqLength=16, packing=False)
    cut = preflight(short, tmp_path)
    assert [len(s["pairs"]) for s in cut.train] == [1] * 64
    assert cut.notes == ("truncated 64 of 64 preference pairs to maxSeqLength 16 tokens a side "
                         "(kept the answers and the end of each prompt; raise "
                         "spec.dataset.maxSeqLength to keep them whole)",)


def test_the_preflight_refuses_an_objective_the_data_does_not_fit(tiny_model_dir, tmp_path):
    from finetune_trainer.train import preflight

    chats = REPO / "examples/data/tiny-chat.jsonl"
    with pytest.raises(DataError) as refused:
        preflight(trainer_config(chats, tiny_model_dir, tmp_path, "dpo"), tmp_path)
    assert (refused.value.where, refused.value.what) == (
        str(chats), "is laid out as chat, and objective dpo trains on preference data")
    assert refused.value.fix == ("set spec.objective.type to sft, or lay the data out as "
                                 "preference records (spec.dataset.format)")
    with pytest.raises(DataError) as refused:
        preflight(trainer_config(PREFERENCES, tiny_model_dir, tmp_path, "sft"), tmp_path)
    assert refused.value.what == ("is laid out as preference, and objective sft trains on "
                                  "chat, instruction or text data")
    assert refused.value.fix.startswith("set spec.objective.type to dpo, or ")


# --- the losses ----------------------------------------------------------------------------

# three pairs' answer log-probabilities, chosen at even indices: log-ratios to the reference
# chosen 1, 0.5, -1 and rejected -2, 1, 2, so margins 3, -0.5, -3
POLICY = [-10.0, -14.0, -7.5, -6.0, -20.0, -21.0]
REFERENCE = [-11.0, -12.0, -8.0, -7.0, -19.0, -23.0]
LENGTHS = [4.0, 8.0, 3.0, 2.0, 10.0, 5.0]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def expected_losses(kind: str, beta: float, smoothing: float) -> list[float]:
    """The papers' (and TRL's) formulas, pair by pair, in plain floats."""
    out = []
    for k in range(3):
        chosen = POLICY[2 * k] - REFERENCE[2 * k]
        rejected = POLICY[2 * k + 1] - REFERENCE[2 * k + 1]
        z = chosen - rejected
        if kind == "sigmoid":  # DPO; conservative DPO with label smoothing
            out.append(-(1 - smoothing) * log_sigmoid(beta * z)
                       - smoothing * log_sigmoid(-beta * z))
        elif kind == "ipo":  # on the per-token mean log-ratios
            mean = chosen / LENGTHS[2 * k] - rejected / LENGTHS[2 * k + 1]
            out.append((mean - 1 / (2 * beta)) ** 2)
        else:  # robust DPO
            out.append(((1 - smoothing) * -log_sigmoid(beta * z)
                        - smoothing * -log_sigmoid(-beta * z)) / (1 - 2 * smoothing))
    return out


@pytest.mark.parametrize(("kind", "beta", "smoothing"), [
    ("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0), ("ipo", 2.0, 0.0),
    ("robust", 0.1, 0.1), ("robust", 1.0, 0.0), ("robust", 0.3, 0.4)])
def test_dpo_losses_are_the_papers_formulas(kind, beta, smoothing):
    policy = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    settings = DpoConfig(beta=beta, loss=kind, labelSmoothing=smoothing)
    pairs = dpo_losses(policy, torch.tensor(REFERENCE, dtype=torch.float64),
                       torch.tensor(LENGTHS, dtype=torch.float64), settings)
    assert pairs.losses.tolist() == pytest.approx(expected_losses(kind, beta, smoothing),
                                                  rel=1e-12)
    # rewards: beta x log-ratio, no gradient through them
    assert pairs.chosen_rewards.tolist() == pytest.approx([beta * r for r in (1, 0.5, -1)])
    assert pairs.rejected_rewards.tolist() == pytest.approx([beta * r for r in (-2, 1, 2)])
    assert pairs.losses.requires_grad and not pairs.chosen_rewards.requires_grad
    # chosen 0.5 beta in all, rejected beta, margins -0.5 beta; only the first pair is won
    assert pairs.reward_sums().tolist() == pytest.approx([0.5 * beta, beta, -0.5 * beta, 1.0])
    assert pairs.reward_sums().dtype == torch.float64
    # a step down the loss raises each chosen answer and lowers each rejected one (ipo
    # pushes the margin to 1/(2 beta), and conservative DPO to where its smoothing holds
    # it, from either side)
    if kind == "robust" or (kind == "sigmoid" and not smoothing):
        pairs.losses.sum().backward()
        assert (policy.grad[0::2] < 0).all() and (policy.grad[1::2] > 0).all()


def test_the_losses_without_smoothing_agree():
    """Smoothing 0: robust DPO is DPO; DPO is -log sigmoid(beta x margin)."""
    args = (torch.tensor(POLICY), torch.tensor(REFERENCE), torch.tensor(LENGTHS))
    plain = dpo_losses(*args, DpoConfig(beta=0.25)).losses
    robust = dpo_losses(*args, DpoConfig(beta=0.25, loss="robust")).losses
    assert torch.allclose(plain, robust)
    assert torch.allclose(plain, -F.logsigmoid(0.25 * torch.tensor([3.0, -0.5, -3.0])))


def test_a_tied_pair_counts_no_accuracy():
    """As TRL's rewards/accuracies: the chosen answer's reward must be higher."""
    policy = torch.tensor([-5.0, -6.0, -3.0, -4.0])
    reference = torch.tensor([-6.0, -7.0, -3.0, -5.0])  # ratios 1, 1 (a tie) and 0, 1
    sums = dpo_losses(policy, reference, torch.ones(4), DpoConfig(beta=0.5)).reward_sums()
    assert sums.tolist() == [0.5, 1.0, -0.5, 0.0]


def test_answer_lengths_count_each_answers_trained_tokens():
    batch = {"loss_answers": torch.tensor([0, 0, 1, 3, 3, 3])}
    assert answer_lengths(batch, 6).tolist() == [2.0, 1.0, 0.0, 3.0, 0.0, 0.0]


# --- answer log-probabilities of a model ---------------------------------------------------

def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def packed_batch(tokenizer, count: int = 6) -> tuple[dict, list[dict]]:
    """`count` shipped pairs packed two rows deep, as the trainer's Collation makes them."""
    records = shipped(count)
    sequences = pack(tokenize_pairs(records, tokenizer, max_length=64).samples,
                     max_length=128)
    assert len(sequences) >= 2 and any(len(s["pairs"]) > 1 for s in sequences)
    batch = collate(sequences, tokenizer.pad_token_id, paired=True)
    batch.update(loss.answer_targets(batch["labels"], batch["answers"]))
    return batch, records


def each_answer_alone(model, batch, records, tokenizer) -> torch.Tensor:
    """Each answer's log-probability from the logits of prompt + answer as one sequence of
    its own: log_softmax, the answer's tokens gathered, summed."""
    out = []
    for pid in batch["pairs"].tolist():
        prompt, *answers = pair_tokens(records[pid], tokenizer)
        for answer in answers:
            ids = torch.tensor([prompt + answer])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0].float()
            predicted = logits[len(prompt) - 1:-1].log_softmax(-1)
            out.append(float(predicted.gather(1, torch.tensor(answer)[:, None]).sum()))
    return torch.tensor(out)


def test_answer_logps_of_packed_pairs_are_each_answers_own(tiny_model_dir, tiny_tokenizer):
    """Plain and fused heads alike: each answer's summed token log-probability, as if it
    were alone with its prompt (no answer sees the other, nor another pair)."""
    batch, records = packed_batch(tiny_tokenizer)
    model = tiny_model(tiny_model_dir)
    expected = each_answer_alone(model, batch, records, tiny_tokenizer)
    with torch.no_grad():
        plain = loss.answer_logps(model, batch, None)
    assert plain.shape == (2 * len(batch["pairs"]),)
    assert torch.allclose(plain, expected, atol=1e-4, rtol=1e-5), (plain, expected)
    head = loss.install(model)
    with torch.no_grad():
        fused = loss.answer_logps(model, batch, head)
    assert torch.allclose(fused, expected, atol=1e-4, rtol=1e-5), (fused, expected)
    assert head.targets is None and not head.per_row  # an ordinary Linear again
    lengths = answer_lengths(batch, plain.shape[0]).tolist()
    assert lengths == [float(len(answer)) for pid in batch["pairs"].tolist()
                       for answer in pair_tokens(records[pid], tiny_tokenizer)[1:]]


def test_fused_answer_logps_give_the_plain_gradients(tiny_model_dir, tiny_tokenizer):
    batch, _ = packed_batch(tiny_tokenizer, count=4)
    weights = torch.linspace(-1, 1, 2 * len(batch["pairs"]))  # a loss of all the answers
    grads = []
    for fused in (False, True):
        model = tiny_model(tiny_model_dir)
        head = loss.install(model) if fused else None
        (loss.answer_logps(model, batch, head) * weights).sum().backward()
        grads.append((model.lm_head.weight.grad.clone(),
                      model.model.embed_tokens.weight.grad.clone()))
    for plain, fused in zip(*grads, strict=True):
        assert torch.allclose(plain, fused, atol=1e-5, rtol=1e-4)


def dpo_objective(settings: DpoConfig, strategy):
    """DPO's trainer side as a LoRA run builds it (`spec.objective.dpo: settings`), attached
    to `strategy` with no fused head."""
    config = TrainerConfig.model_validate({
        "job": {"name": "pairs"}, "model": {"uri": "/models/m"}, "dataset": {"uri": "/data"},
        "objective": {"type": "dpo", "dpo": settings.model_dump(by_alias=True)},
        "method": {"type": "lora"}, "strategy": {"type": "ddp"},
        "hyperparameters": {"maxSteps": 1}, "output": {"uri": "/out"}})
    objective = spec_of("dpo").objective(config)
    objective.attach(RunContext(strategy, None, None, None, 1, REPO, 0))
    return objective


def test_the_objective_reads_the_reference_of_its_pairs_from_the_table(tiny_model_dir,
                                                                      tiny_tokenizer):
    """Full weights: the reference is the table taken before the first step, indexed by the
    batch's pair ids (chosen, rejected of each, in the batch's order)."""
    batch, _ = packed_batch(tiny_tokenizer)
    model = tiny_model(tiny_model_dir)
    table = torch.arange(12, dtype=torch.float64).view(6, 2) * -1.5 - 20
    settings = DpoConfig(beta=0.2)
    objective = dpo_objective(settings, types.SimpleNamespace(model=model))
    objective.table = table
    reference = objective.reference(batch)
    assert reference.tolist() == [table[p, side].item() for p in batch["pairs"].tolist()
                                  for side in (0, 1)]
    summed, rewards = objective.summed(batch)
    policy = loss.answer_logps(model, batch, None)
    pairs = dpo_losses(policy, reference.float(), answer_lengths(batch, 12), settings)
    assert summed.item() == pytest.approx(pairs.losses.sum().item(), rel=1e-6)
    assert rewards.tolist() == pytest.approx(pairs.reward_sums().tolist(), rel=1e-6)
    assert summed.requires_grad


def test_the_reference_of_an_adapter_run_is_the_base_with_adapters_off(tiny_model_dir,
                                                                       tiny_tokenizer):
    from peft import LoraConfig, get_peft_model

    batch, _ = packed_batch(tiny_tokenizer, count=4)
    model = tiny_model(tiny_model_dir)
    with torch.no_grad():
        base = loss.answer_logps(model, batch, None)
    torch.manual_seed(0)
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                               init_lora_weights=False))
    strategy = types.SimpleNamespace(model=adapted, unwrapped=lambda: adapted)
    objective = dpo_objective(DpoConfig(), strategy)
    reference = objective.reference(batch)
    assert torch.allclose(reference, base, atol=1e-5) and not reference.requires_grad
    policy = loss.answer_logps(adapted, batch, None)
    assert not torch.allclose(policy, base, atol=1e-3)  # the adapters are on again
    summed, rewards = objective.summed(batch)
    assert summed.requires_grad
    assert rewards[0].item() == pytest.approx(0.1 * float((policy - base)[0::2].sum()),
                                              rel=1e-4)
