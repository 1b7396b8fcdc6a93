"""What a plain `finetune run` shows of torchrun's and the workers' output."""

from __future__ import annotations

import sys

import pytest

from finetune_operator.local.logs import QuietLog
from finetune_operator.local.output import stopped_message
from finetune_operator.local.processes import run_step

SIGNAL_TRACEBACK = """Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/torch/distributed/run.py", line 1032, in <module>
    main()
           ^^^^^^^^^^^^^
torch.distributed.elastic.multiprocessing.api.SignalException: Process 24266 got signal: 15
"""
WORKER_TRACEBACK = """Traceback (most recent call last):
  File "/src/train.py", line 10, in run
    raise ValueError("boom")
ValueError: boom
"""


def shown(text: str, stopping: bool = False) -> str:
    log = QuietLog(lambda: stopping)
    kept = [k for line in text.splitlines(keepends=True) for k in log.feed(line)]
    return "".join(kept + log.flush())


def test_loading_bars_banner_and_the_stop_it_asked_for_are_dropped():
    text = ("Loading weights:   0%|          | 0/21\n"
            "Loading weights: 100%|##########| 21/21\n"
            "\n"
            "*****************************************\n"
            "Setting OMP_NUM_THREADS environment variable for each process to be 1\n"
            "W1122 22:21:03.190000 24266 torch/distributed/elastic/agent/server/api.py:753] "
            "Received 15 death signal, shutting down workers\n"
            "step 129/4000 | loss 5.1297\n"
            "stopped by SIGTERM after step 129; a restart resumes from the checkpoint above\n")
    assert shown(text) == "step 129/4000 | loss 5.1297\n"


def test_a_reason_every_rank_and_the_launcher_say_is_shown_once():
    """Each worker refuses the data before it joins, torchrun logs the exit code, and the
    launcher says the first failed rank's reason again: one line in the terminal. Another
    reason (another rank's, another failure) is still shown."""
    said = "finetune-train: spec.objective.grpo.rewards mine:score: returned 7 values\n"
    text = (said + said + "E1129 06:49:51.273000 13720 torch/distributed/elastic/"
            "multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 0 (pid: 13728) of "
            "binary: /venv/bin/python\n" + said)
    assert shown(text) == said
    other = "finetune-train: rank 1 was ended by SIGKILL\n"
    assert shown(said + other + said + "step 3/6\n" + "step 3/6\n") == (
        said + other + "step 3/6\n" + "step 3/6\n")  # only the reasons are said once


def test_the_blank_lines_a_bar_leaves_before_it_go_with_it_and_others_stay():
    # a pipe read in text mode turns a bar's carriage returns into line ends
    text = ("\nGenerating train split: 0 examples\nGenerating train split: 64 examples\n\n"
            "preflight: 16 training sequences\n\nstep 1/2\n\n")
    assert shown(text) == "preflight: 16 training sequences\n\nstep 1/2\n\n"


@pytest.mark.process
def test_a_step_before_the_workers_is_shown_as_they_are(tmp_path, capfd):
    """A step before the workers (an hf:// model's fetch) is filtered as they are: a bar
    the workers' filter drops, a plain `finetune run` drops there too, `--verbose` shows it,
    the run log keeps it either way."""
    script = ("import sys, tqdm\n"
              "for _ in tqdm.tqdm(range(64), desc='Generating train split'): pass\n"
              "print('preflight: 16 training sequences')\n")
    log = tmp_path / "logs" / "run.log"
    assert run_step([sys.executable, "-c", script], log, verbose=False) == 0
    out, err = capfd.readouterr()
    assert out == "preflight: 16 training sequences\n"
    assert err == ""
    assert "Generating train split: 100%" in log.read_text()
    assert run_step([sys.executable, "-c", script + "sys.exit(2)"], log, verbose=True) == 2
    assert "Generating train split" in capfd.readouterr().err


def test_torchruns_signal_traceback_goes_only_when_finetune_run_stopped_it():
    assert shown(SIGNAL_TRACEBACK, stopping=True) == ""
    assert shown(SIGNAL_TRACEBACK, stopping=False) == SIGNAL_TRACEBACK


def test_a_second_ctrl_c_while_torchrun_stops_shows_nothing_of_its_traceback():
    """The agent's handling of the first SIGTERM is cut by the second: Python chains the
    two tracebacks ('During handling of the above exception ...'), which leaked that line."""
    chained = (SIGNAL_TRACEBACK + "\nDuring handling of the above exception, another "
               "exception occurred:\n\n" + SIGNAL_TRACEBACK.replace("24266", "24267"))
    assert shown(chained + "interrupted\n", stopping=True) == "interrupted\n"
    assert shown(chained, stopping=False) == chained
    # a real error chained to the stop is shown with the stop it came from
    real = (SIGNAL_TRACEBACK + "\nDuring handling of the above exception, another "
            "exception occurred:\n\n" + WORKER_TRACEBACK)
    assert shown(real, stopping=True) == real


def test_a_workers_traceback_passes_whole_even_while_stopping():
    assert shown(WORKER_TRACEBACK, stopping=True) == WORKER_TRACEBACK
    assert shown("step 1\n" + WORKER_TRACEBACK[:60]) == "step 1\n" + WORKER_TRACEBACK[:60]


def test_the_stop_message_names_the_checkpoint_or_says_there_is_none(tmp_path):
    assert stopped_message(tmp_path) == ("interrupted before the first checkpoint; run the "
                                         "same command to start again")
    done = tmp_path / "checkpoints" / "step-00000061"
    done.mkdir(parents=True)
    (done / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoints" / "step-00000070").mkdir()  # not complete: no state file
    assert stopped_message(tmp_path) == (
        f"interrupted; checkpoint at step 61 in {tmp_path / 'checkpoints'}; run the same "
        "command to resume")
