"""Fuzz `finetune validate`, `render` and `plan` with generated manifests (#25).

    .venv/bin/python -m tests.support.fuzz_manifests --count 3000 [--seed N] [--timeout 20]

Each manifest of `tests.support.manifest_generator` (the examples, mutated) goes through
`finetune validate` (text and json), `finetune render` and `finetune plan --offline`
(table and json), in this process, and is held to what a user may expect:
- no traceback, and an answer within `--timeout` seconds of CPU time (a hang);
- every line on stderr starts with the file and names a field or a file position, so a
  refusal is one line that says where; no character a terminal would obey (escapes, line
  separators) is printed raw;
- `validate` accepts only what `render` renders for the same backend (and refuses only
  what render refuses), apart from relative paths: validate warns they are for
  `finetune run` and render refuses them;
- render's output is YAML, plan's JSON is JSON.
Prints the figures and the first findings of each kind with the seed and index that
reproduce them; exits 1 when anything was found. tests/api/test_manifest_agreement.py
runs the same checks over a bounded count.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from click.testing import CliRunner

from finetune_operator.cli import main as finetune
from tests.support.manifest_generator import Generated, manifests

COMMANDS = {
    "validate": ["validate"],
    "validate-json": ["validate", "-o", "json"],
    "render": ["render"],
    "plan": ["plan", "--offline"],
    "plan-json": ["plan", "--offline", "-o", "json"],
}
_KEY = r"(?:[A-Za-z_$][\w$-]*|\(document\)|\[[^\]]*\])"
FIELD = rf"{_KEY}(?:\.[A-Za-z_$][\w$-]*|\[[^\]]*\])*(?: \([^)]*\))?: "
"""A field path and its colon: `spec.model.uri: `, `spec["a b"]: `, `[""]: `, `gpus: `,
`spec.azureml (environment): ` (what the Azure ML SDK names)."""
FILE_LEVEL = ("no FineTuneJob found", "skipped ", "holds ", "cannot read", "nests YAML",
              "not UTF-8")
"""What a line may say about the file as a whole (no field to name)."""
RELATIVE_REFUSAL = re.compile(r"^spec\.(model|dataset|output)\.uri: ")


class Hang(Exception):
    pass


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str
    error: str | None = None
    """The traceback, when there was one."""


@dataclass
class Finding:
    kind: str  # traceback, hang, unprefixed, disagreement, output
    command: str
    detail: str


@dataclass
class Checked:
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)


def run(args: list[str], timeout: float) -> Outcome:
    """One command in-process; a Hang once it has spent `timeout` seconds of CPU (a hang
    here is work without end: counted in the CPU it burns, not in the wall-clock time a
    busy machine stretches, which once tripped a 20 s wall-clock alarm under load 10)."""
    def alarm(signum, frame):
        raise Hang(f"no answer within {timeout} s of CPU time")

    previous = signal.signal(signal.SIGVTALRM, alarm)
    signal.setitimer(signal.ITIMER_VIRTUAL, timeout)
    try:
        result = CliRunner().invoke(finetune, args)
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)
    error = None
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        error = "".join(traceback.format_exception(*result.exc_info))
    return Outcome(result.exit_code, result.stdout, result.stderr, error)


def unprefixed(source: str, stderr: str) -> list[str]:
    """The stderr lines that do not start with the file and name a field or a position."""
    prefix = re.compile(rf"^{re.escape(source)}(#\d+)?(?P<pos>:\d+(:\d+)?)?: (warning: )?")
    bad = []
    for line in stderr.splitlines():
        match = prefix.match(line)
        rest = line[match.end():] if match else ""
        if not match or not (match.group("pos") or re.match(FIELD, rest)
                             or rest.startswith(FILE_LEVEL)):
            bad.append(line)
    return bad


def refusals(source: str, stderr: str) -> list[str]:
    """The error lines (not warnings) of a command, without the file prefix."""
    out = []
    for line in stderr.splitlines():
        rest = re.sub(rf"^{re.escape(source)}(#\d+)?: ", "", line)
        if not rest.startswith("warning: "):
            out.append(rest)
    return out


def check(manifest: Generated | str, folder: Path, timeout: float = 20.0) -> Checked:
    """Run every command on one manifest and hold the answers to the rules above."""
    text = manifest if isinstance(manifest, str) else manifest.text
    path = folder / "job.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    source = str(path)
    checked = Checked()
    for name, args in COMMANDS.items():
        try:
            outcome = run([*args, source], timeout)
        except Hang as error:
            checked.findings.append(Finding("hang", name, str(error)))
            continue
        checked.outcomes[name] = outcome
        if outcome.error:
            kind = "hang" if "Hang: no answer" in outcome.error else "traceback"
            checked.findings.append(Finding(kind, name, outcome.error))
            continue
        if outcome.code not in ((0, 1, 2) if name.startswith("plan") else (0, 2)):
            checked.findings.append(Finding("output", name, f"exit {outcome.code}"))
        if bad := unprefixed(source, outcome.stderr):
            checked.findings.append(Finding("unprefixed", name, "\n".join(bad[:3])))
        if raw := {c for c in outcome.stdout + outcome.stderr
                   if not c.isprintable() and c not in "\n\t"}:
            checked.findings.append(Finding(  # an escape sequence, a forged line break
                "output", name, f"unprintable characters {sorted(raw)!r} in the output"))
        if name == "validate" and not outcome.stdout.strip() and not outcome.stderr.strip():
            checked.findings.append(Finding("output", name, "said nothing"))
        try:
            if name == "render" and outcome.code == 0:
                assert list(yaml.safe_load_all(outcome.stdout)), "no objects"
            if name == "validate-json" or (name == "plan-json" and outcome.code in (0, 1)):
                json.loads(outcome.stdout)
        except (AssertionError, ValueError, yaml.YAMLError) as error:
            checked.findings.append(Finding("output", name, f"unreadable output: {error}"))
    validate, render = checked.outcomes.get("validate"), checked.outcomes.get("render")
    if validate and render and not validate.error and not render.error:
        if validate.code == 0 and render.code != 0:
            refused = refusals(source, render.stderr)
            relative_only = refused and all(RELATIVE_REFUSAL.match(r) for r in refused) and (
                "relative paths" in validate.stderr)
            if not relative_only:
                checked.findings.append(Finding(
                    "disagreement", "validate/render",
                    "validate accepts, render refuses: " + " | ".join(refused[:3])))
        elif validate.code != 0 and render.code == 0:
            checked.findings.append(Finding(
                "disagreement", "validate/render",
                "validate refuses, render renders: " + " | ".join(
                    refusals(source, validate.stderr)[:3])))
    return checked


def _cut(text: str, width: int = 300, lines: int = 40) -> str:
    """A finding as a reader can take it in: long lines and long tracebacks shortened."""
    kept = [line if len(line) <= width else line[:width] + "…" for line in text.splitlines()]
    return "\n".join(kept if len(kept) <= lines else [*kept[:8], "  …", *kept[-(lines - 9):]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--timeout", type=float, default=20.0,
                        help="seconds one command may take before it counts as a hang")
    parser.add_argument("--show", type=int, default=3, help="findings shown per kind")
    args = parser.parse_args(argv)
    started = time.monotonic()
    kinds: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    shown: Counter[str] = Counter()
    slowest = (0.0, -1)
    with tempfile.TemporaryDirectory() as where:
        for index, generated in enumerate(manifests(args.seed, args.count)):
            began = time.monotonic()
            checked = check(generated, Path(where), args.timeout)
            slowest = max(slowest, (time.monotonic() - began, index))
            for name, outcome in checked.outcomes.items():
                codes[f"{name} exit {outcome.code}"] += 1
            for finding in checked.findings:
                kinds[finding.kind] += 1
                if shown[finding.kind] < args.show:
                    shown[finding.kind] += 1
                    print(_cut(f"--- {finding.kind} in {finding.command}: seed {args.seed} "
                               f"index {index} ({generated.example}: "
                               f"{'; '.join(generated.mutations)})\n{finding.detail.rstrip()}\n"))
            if (index + 1) % 500 == 0:
                print(f"... {index + 1} manifests, {sum(kinds.values())} findings",
                      file=sys.stderr)
    elapsed = time.monotonic() - started
    print(f"seed {args.seed}: {args.count} manifests x {len(COMMANDS)} commands in "
          f"{elapsed:.0f} s (slowest manifest {slowest[0]:.1f} s, index {slowest[1]})")
    print("exit codes: " + ", ".join(f"{k}: {v}" for k, v in sorted(codes.items())))
    for kind in ("traceback", "hang", "unprefixed", "disagreement", "output"):
        print(f"{kind}: {kinds[kind]}")
    return 1 if kinds else 0


if __name__ == "__main__":
    sys.exit(main())
