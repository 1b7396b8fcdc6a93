"""`finetune validate` on whatever a user or a broken pipeline hands it: any bytes, any
YAML (dates, binary, sets, huge numbers, deep nesting, alias bombs, many documents), the
examples mangled. The answer is exit 0 or 2 with one short line per problem — never a
traceback, never a hang, never megabytes of output."""

from __future__ import annotations

import datetime
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from finetune_operator.cli import main
from tests.conftest import EXAMPLES, REPO, minimal_job
from tests.support import waits

MAX_OUTPUT = 20_000  # characters: a problem line quotes at most a short part of a value

yaml_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10**30, 10**30), st.floats(),
    st.text(max_size=20), st.binary(max_size=8), st.dates(),
    st.datetimes(timezones=st.just(datetime.timezone.utc)))
yaml_values = st.recursive(yaml_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.text(max_size=10), st.integers(), st.booleans()), inner,
                    max_size=4),
    st.sets(st.text(max_size=5), max_size=3)), max_leaves=12)


@st.composite
def manifests(draw) -> bytes:
    """A FineTuneJob with some section replaced by any YAML value, dumped by PyYAML."""
    doc = minimal_job()
    where = draw(st.sampled_from(["spec", "metadata", "apiVersion", "kind", None]))
    section = draw(st.sampled_from([*sorted(doc["spec"]), "kubernetes", "runPolicy"]))
    value = draw(yaml_values)
    if where == "spec":
        doc["spec"][section] = value
    elif where is not None:
        doc[where] = value
    documents = [doc, *draw(st.lists(yaml_values, max_size=2))]
    return yaml.dump_all(documents, allow_unicode=True).encode()


@st.composite
def mangled(draw, data: bytes) -> bytes:
    at = draw(st.integers(0, len(data)))
    how = draw(st.sampled_from(["truncate", "insert", "replace"]))
    if how == "truncate":
        return data[:at]
    junk = draw(st.binary(min_size=1, max_size=6) | st.sampled_from(
        [b":", b"- ", b"\t", b"{", b"]", b"&a ", b"*a", b"!!binary ", b"---\n", b"\xff"]))
    return data[:at] + junk + data[at + (len(junk) if how == "replace" else 0):]


inputs = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    manifests(),
    st.sampled_from(EXAMPLES).map(Path.read_bytes).flatmap(mangled),
)


def validate(content: bytes) -> tuple[int, str, BaseException | None]:
    with tempfile.TemporaryDirectory() as where:
        path = Path(where) / "job.yaml"
        path.write_bytes(content)
        result = CliRunner().invoke(main, ["validate", str(path)])
    error = None if isinstance(result.exception, SystemExit) else result.exception
    return result.exit_code, result.output, error


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(content=inputs)
def test_validate_answers_any_input_with_an_exit_code_and_lines(content):
    code, output, error = validate(content)
    assert error is None, f"{type(error).__name__}: {error}"
    assert code in (0, 2), output
    assert len(output) < MAX_OUTPUT
    lines = output.strip().splitlines()
    assert lines  # valid or not, it says something
    if code == 2:
        assert any(" — " in line for line in lines), output  # what is wrong — the fix


ALIAS_BOMB = "".join(
    f"l{i}: &l{i} [{', '.join([f'*l{i - 1}' if i else 'x'] * 10)}]\n" for i in range(7))


@pytest.mark.parametrize(("content", "expected"), [
    (b"apiVersion: finetune.dev/v1alpha1\nkind: FineTuneJob\nmetadata: {name: caf\xe9}\n",
     ":3: not UTF-8 text (byte 0xe9) — save the manifest as UTF-8"),
    ("kind: FineTuneJob\n".encode("utf-16"), ":1: not UTF-8 text (byte 0xff)"),
    (b"[" * 5000 + b"]" * 5000, ": nests YAML too deeply to read"),
    (b"spec: {hyperparameters: {maxSteps: " + b"9" * 5000 + b"}}\n",
     ": holds a value that cannot be read"),
    # 10^7 leaves through aliases: read by reference, quoted in a few characters
    ((ALIAS_BOMB + yaml.safe_dump(minimal_job()).replace(
        "maxSteps: 10", "maxSteps: *l6")).encode(),
     ": spec.hyperparameters.maxSteps: must be an integer, got [[[...], [...], [...], [...]"),
], ids=["latin-1", "utf-16", "deep", "huge-int", "alias-bomb"])
@pytest.mark.process
def test_what_fuzzing_found_is_one_line_from_the_real_command(tmp_path, content, expected):
    """Each of these was a traceback (or, for the alias bomb, 5 MB of output) before."""
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    result = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "validate",
                             str(path)], capture_output=True, text=True, cwd=REPO,
                            timeout=waits.seconds_left())
    assert result.returncode == 2, result.stderr
    assert f"{path}{expected}" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr) < MAX_OUTPUT


@pytest.mark.process
def test_stdin_that_is_not_utf8_is_named():
    result = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "validate", "-"],
                            input=b"kind: \xff\n", capture_output=True, cwd=REPO,
                            timeout=waits.seconds_left())
    assert result.returncode == 2
    assert b"-:1: not UTF-8 text (byte 0xff)" in result.stderr
