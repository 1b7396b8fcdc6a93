"""#51: docs/troubleshooting.md lists every reason the operator can set, checked against the
code, so the page cannot go stale without a test saying which reason.

The reasons are read from the source with `ast`, not by running it:

- a condition's: every call `cond(type, value, reason, ...)` (`_Builder.cond`) and
  `set_condition(status, type, value, reason, ...)` whose type is a string literal; the
  reason is a literal, a module-level constant, a local assigned from those (`x or "Y"`,
  `"A" if c else "B"`), or a parameter of the function around it, followed to the literals
  its callers pass and its default (`fail(reason, ...)`, `_degraded(b, reason, ...)`,
  `_wait_for_queue(b, reason=...)`);
- the Failed condition's, besides: the `reason` of every `Failure(...)` and its default;
- an event's: the second argument of every `event(...)` and `Event(...)` call, followed the
  same way (`_Builder.phase` posts each phase it is called with as an event);
- the kubelet's and the scheduler's words `states.blocking_reason` turns into the Running
  condition's reason: the alternatives of `_UNPULLABLE`, `_SAME_CAUSE`, `MOUNT_REASONS`, a
  `Reason: ...` f-string the module writes (`FailedCreate: ...`) and a `.get("reason",
  "Default")` default (`Unschedulable`);
- the trainer's exit codes: `finetune_trainer/exits.py`'s `EXIT_*` and `STOPPED`;
- the phases (`api.Phase`) and the pod reasons read as a preemption (`DISRUPTION_REASONS`).

Each must have its row in its section, and each row must name something the code still sets
there. The page's links must stay under docs/ and its anchors name its own headings.

Blind spots: a reason computed at run time (an attribute, an f-string, a dict lookup) is not
followed, nor a parameter further than a few calls up, nor a call through another name (a
callback, `getattr`). A kubelet reason the states module passes through without naming it
(`CreateContainerConfigError`) is one of `EXTERNAL`. The page is read as Markdown tables
whose first cell is one backticked word, under `## ` headings named below."""

from __future__ import annotations

import ast
import re
import unicodedata
from dataclasses import dataclass, field

from tests.conftest import REPO

DOCS = REPO / "docs"
PAGE = DOCS / "troubleshooting.md"
PACKAGE = REPO / "operator" / "finetune_operator"
STATES = "backends/kubernetes/states.py"
EXITS = REPO / "trainer" / "finetune_trainer" / "exits.py"
API = PACKAGE / "api.py"
SWEEP_MODULES = ("sweep.py", "sweep_controller.py")

PHASES = "Start from the phase"
WAITING = "Workers waiting"
EVENTS = "Events"
SWEEP = "FineTuneSweep"
EXIT_CODES = "The trainer's exit codes"
NOT_REASONS = {PHASES, EXIT_CODES}
"""Sections whose tables list phases and exit codes, not reasons."""

EXTERNAL = {
    "CreateContainerConfigError": "the kubelet: a Secret, ConfigMap or key a container needs "
                                  "is missing (states' _MISSING_OBJECT, _MISSING_KEY)",
    "CreateContainerError": "the kubelet: the runtime could not create the container",
    "RunContainerError": "the kubelet: the runtime could not start the container",
    "SchedulingGated": "the scheduler's PodScheduled reason while a pod has scheduling gates",
}
"""Words of others that the page documents and the code passes on as the Running
condition's reason without naming them (`blocking_reason` matches any `Reason:`)."""
EXTERNAL_EXIT_CODES = {137: "128 + SIGKILL: the kernel's out-of-memory killer (OOMKilled)"}

FOLLOW_DEPTH = 4
"""How many calls up a reason parameter is followed to its literals."""


# --- the code's reasons ---------------------------------------------------------------------

@dataclass
class Reasons:
    conditions: dict[str, set[str]] = field(default_factory=dict)
    """Condition type → the reasons set on it."""
    failures: set[str] = field(default_factory=set)
    """`Failure` reasons: the Failed condition's, when a backend refuses a job."""
    events: dict[str, set[str]] = field(default_factory=dict)
    """Module (relative path) → the reasons of the events posted there."""

    def every(self) -> set[str]:
        return (set().union(*self.conditions.values(), *self.events.values())
                | self.failures)


class _Source:
    """The parsed modules, and what following a reason to its literals needs."""

    def __init__(self, sources: dict[str, str]):
        self.trees = {name: ast.parse(text, name) for name, text in sources.items()}
        self.constants: dict[str, set[str]] = {}
        self.functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.calls: dict[str, list[tuple[ast.Call, ast.AST | None, str]]] = {}
        self.enclosing: dict[ast.AST, ast.AST] = {}
        for module, tree in self.trees.items():
            self._index(module, tree)

    def _index(self, module: str, tree: ast.Module) -> None:
        for node in tree.body:
            target, value = _assigned(node)
            if target and isinstance(value, ast.Constant) and isinstance(value.value, str):
                self.constants.setdefault(target, set()).add(value.value)
        for node in ast.walk(tree):  # outer functions first: an inner one overrides
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, []).append(node)
                for inner in ast.walk(node):
                    self.enclosing[inner] = node
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (name := _callee(node)):
                self.calls.setdefault(name, []).append(
                    (node, self.enclosing.get(node), module))

    def values(self, expr: ast.AST | None, where: ast.AST | None, depth: int = 0) -> set[str]:
        """The strings `expr` can be, as far as the source says."""
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return {expr.value}
        if isinstance(expr, ast.IfExp):
            return self.values(expr.body, where, depth) | self.values(expr.orelse, where, depth)
        if isinstance(expr, ast.BoolOp):
            return set().union(*(self.values(v, where, depth) for v in expr.values))
        if not isinstance(expr, ast.Name):
            return set()  # computed at run time: not followed
        if isinstance(where, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if expr.id in _parameters(where):
                return self._passed(where, expr.id, depth)
            assigned = [value for node in ast.walk(where)
                        for target, value in [_assigned(node)] if target == expr.id]
            if assigned:
                return set().union(*(self.values(v, where, depth) for v in assigned))
        return set(self.constants.get(expr.id, ()))

    def _passed(self, function: ast.FunctionDef | ast.AsyncFunctionDef, param: str,
                depth: int) -> set[str]:
        """What the callers of `function` pass for `param`, and its default."""
        if depth >= FOLLOW_DEPTH:
            return set()
        params = _parameters(function)
        found = self.values(_default(function, param), None, depth)
        method = bool(params) and params[0] in ("self", "cls")
        index = params.index(param)
        for call, caller, _ in self.calls.get(function.name, ()):
            offset = 1 if method and isinstance(call.func, ast.Attribute) else 0
            argument = next((k.value for k in call.keywords if k.arg == param), None)
            if argument is None and 0 <= index - offset < len(call.args):
                argument = call.args[index - offset]
            found |= self.values(argument, caller, depth + 1)
        return found


def _assigned(node: ast.AST) -> tuple[str | None, ast.AST | None]:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
            node.targets[0], ast.Name):
        return node.targets[0].id, node.value
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id, node.value
    return None, None


def _callee(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = function.args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]


def _default(function: ast.FunctionDef | ast.AsyncFunctionDef, param: str) -> ast.AST | None:
    args = function.args
    positional = [*args.posonlyargs, *args.args]
    pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults,
                     strict=True))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d]
    return next((d for a, d in pairs if a.arg == param), None)


def _argument(call: ast.Call, index: int, name: str) -> ast.AST | None:
    keyword = next((k.value for k in call.keywords if k.arg == name), None)
    return keyword if keyword is not None else (
        call.args[index] if index < len(call.args) else None)


CONDITION_SINKS = {"cond": (0, 2), "set_condition": (1, 3)}
"""Callee → the positions of (type, reason) in its call."""
EVENT_SINKS = ("event", "Event")


def reasons_in(sources: dict[str, str]) -> Reasons:
    """Every reason `sources` (relative path → Python source) can set, as far as the source
    says without running it."""
    code, found = _Source(sources), Reasons()
    for name, (type_at, reason_at) in CONDITION_SINKS.items():
        for call, where, _ in code.calls.get(name, ()):
            type_ = _argument(call, type_at, "type_")
            if not (isinstance(type_, ast.Constant) and isinstance(type_.value, str)):
                continue  # a wrapper (`cond` itself): its callers are sinks of their own
            found.conditions.setdefault(type_.value, set()).update(
                code.values(_argument(call, reason_at, "reason"), where))
    for name in EVENT_SINKS:
        for call, where, module in code.calls.get(name, ()):
            found.events.setdefault(module, set()).update(
                code.values(_argument(call, 1, "reason"), where))
    for call, where, _ in code.calls.get("Failure", ()):
        found.failures |= code.values(_argument(call, 2, "reason"), where)
    for tree in code.trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Failure":
                found.failures |= {v.value for n in node.body
                                   if _assigned(n)[0] == "reason"
                                   and isinstance(v := _assigned(n)[1], ast.Constant)}
    return found


def code_reasons() -> Reasons:
    return reasons_in({str(p.relative_to(PACKAGE)): p.read_text()
                       for p in sorted(PACKAGE.rglob("*.py"))})


def waiting_reasons(source: str) -> tuple[set[str], dict[str, str]]:
    """The reason words the kubernetes states module can give the Running condition while
    workers wait, and the words it folds into another (`_SAME_CAUSE`)."""
    tree, words = ast.parse(source), set()
    constants = {t: v for node in tree.body for t, v in [_assigned(node)] if t}
    same = ast.literal_eval(constants["_SAME_CAUSE"])
    pattern = constants["_UNPULLABLE"].args[0].value  # re.compile(r"...")
    for group in re.findall(r"\(([A-Za-z|]+)\)", pattern):
        words.update(group.split("|"))
    words.update(ast.literal_eval(constants["MOUNT_REASONS"]))
    words.update(w for node in ast.walk(tree) if (w := _reason_word(node)))
    return {same.get(w, w) for w in words}, same


def _reason_word(node: ast.AST) -> str | None:
    """`Reason` of an f-string `f"Reason: {...}"`, or of a default `x.get("reason",
    "Reason")`: the words the states module writes at the start of a wait."""
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(
            first := node.values[0], ast.Constant):
        said = re.match(r"([A-Z][A-Za-z]+): ", str(first.value))
        return said[1] if said else None
    if (isinstance(node, ast.Call) and _callee(node) == "get" and len(node.args) == 2
            and all(isinstance(a, ast.Constant) for a in node.args)
            and node.args[0].value == "reason"):  # type: ignore[attr-defined]
        word = str(node.args[1].value)  # type: ignore[attr-defined]
        return word if re.fullmatch(r"[A-Z][A-Za-z]+", word) else None
    return None


def exit_codes(source: str) -> dict[int, str]:
    """exits.py's exit codes: value → constant name."""
    return {value.value: name for node in ast.parse(source).body
            for name, value in [_assigned(node)]
            if name and (name.startswith("EXIT_") or name == "STOPPED")
            and isinstance(value, ast.Constant) and isinstance(value.value, int)}


def phases(source: str) -> set[str]:
    """The phases of a FineTuneJob: api.py's `Phase = Literal[...]`."""
    node = next(n for n in ast.parse(source).body if _assigned(n)[0] == "Phase")
    return set(ast.literal_eval(node.value.slice))  # type: ignore[union-attr]


def disruption_words(source: str) -> set[str]:
    """The pod reasons the states module reads as a preemption (`DISRUPTION_REASONS`)."""
    node = next(n for n in ast.parse(source).body
                if _assigned(n)[0] == "DISRUPTION_REASONS")
    return set(ast.literal_eval(node.value.args[0]))  # type: ignore[union-attr]


# --- the page -------------------------------------------------------------------------------

ROW = re.compile(r"^\|\s*`([A-Za-z]+)`\s*\|", re.MULTILINE)
"""A table row whose first cell is one backticked word: a reason (or a phase)."""
EXIT_ROW = re.compile(r"^\|\s*`(\d+)`\s*\|(.*)$", re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def sections(text: str) -> dict[str, str]:
    """`## ` heading → its text (subsections included); the heading is named by what comes
    before ` — ` or `: `, backticks dropped. Fenced code is no heading."""
    found: dict[str, str] = {}
    key, fenced = None, False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("## ") and not fenced:
            key = re.split(r" — |: ", line[3:], maxsplit=1)[0].replace("`", "").strip()
            found[key] = ""
        elif key is not None:
            found[key] += line + "\n"
    return found


def rows(section: str) -> set[str]:
    return set(ROW.findall(section))


@dataclass
class Code:
    """Everything the page is checked against."""

    reasons: Reasons
    waiting: set[str]
    folded: dict[str, str]
    """Waiting words the Running condition says as another (`ImagePullBackOff` →
    `ErrImagePull`): named in the waiting section's text, no row of their own."""

    def allowed(self, key: str) -> set[str] | None:
        """The reasons a section's rows may name (None: a section of no reasons)."""
        events = self.reasons.events
        if key == WAITING:
            return self.waiting | set(EXTERNAL)
        if key == EVENTS:
            return set().union(*(r for m, r in events.items() if m not in SWEEP_MODULES))
        if key == SWEEP:
            return set().union(*(r for m, r in events.items() if m in SWEEP_MODULES))
        if key in self.reasons.conditions:
            return self.reasons.conditions[key] | (
                self.reasons.failures if key == "Failed" else set())
        return None


def undocumented(code: Code, page: dict[str, str]) -> list[str]:
    """Each reason the code sets that has no row where a reader looks for it."""
    found, missing = code.reasons, []
    documented = {key: rows(text) for key, text in page.items() if key not in NOT_REASONS}
    anywhere = set().union(*documented.values())
    for type_, reasons in sorted(found.conditions.items()):
        if type_ not in page:
            missing.append(f"condition {type_}: no section `## {type_}`")
            continue
        # fail() sets Running False with the Failed condition's reason: its row is there
        listed = documented[type_] | (documented.get("Failed", set())
                                      if type_ == "Running" else set())
        missing += [f"{type_}: reason `{r}` has no row under ## {type_}"
                    for r in sorted(reasons - listed)]
    missing += [f"Failed: Failure reason `{r}` has no row under ## Failed"
                for r in sorted(found.failures - documented.get("Failed", set()))]
    for module, reasons in sorted(found.events.items()):
        sweep = module in SWEEP_MODULES
        listed = documented.get(SWEEP, set()) if sweep else anywhere
        missing += [f"event `{r}` ({module}) has no row" + (f" under ## {SWEEP}" if sweep
                                                              else "")
                    for r in sorted(reasons - listed)]
    missing += [f"waiting reason `{r}` has no row under ## {WAITING}"
                for r in sorted(code.waiting - documented.get(WAITING, set()))]
    missing += [f"`{word}` (said as `{code.folded[word]}`) is not named under ## {WAITING}"
                for word in sorted(code.folded)
                if f"`{word}`" not in page.get(WAITING, "")]
    return missing


def stale(code: Code, page: dict[str, str]) -> list[str]:
    """Each row naming a reason its section's code does not set (any more)."""
    wrong = []
    for key, text in page.items():
        if key in NOT_REASONS or not (listed := rows(text)):
            continue
        allowed = code.allowed(key)
        if allowed is None:
            wrong.append(f"## {key} lists reasons, but no condition, event or wait is "
                         f"called {key!r}: {sorted(listed)}")
            continue
        wrong += [f"## {key}: `{r}` is set nowhere in the code (nor in EXTERNAL)"
                  for r in sorted(listed - allowed)]
    return wrong


def the_code() -> Code:
    waiting, folded = waiting_reasons((PACKAGE / STATES).read_text())
    return Code(code_reasons(), waiting, folded)


def the_page() -> dict[str, str]:
    return sections(PAGE.read_text())


# --- the checks -----------------------------------------------------------------------------

def test_every_reason_the_code_sets_has_a_row():
    assert undocumented(the_code(), the_page()) == []


def test_every_row_names_a_reason_the_code_still_sets():
    assert stale(the_code(), the_page()) == []


def test_every_phase_has_a_row():
    assert rows(the_page()[PHASES]) == phases(API.read_text())


def test_every_exit_code_of_the_trainer_has_a_row():
    codes = exit_codes(EXITS.read_text())
    listed = dict(EXIT_ROW.findall(the_page()[EXIT_CODES]))
    assert set(map(int, listed)) == set(codes) | set(EXTERNAL_EXIT_CODES)
    for value, name in codes.items():
        assert f"`{name}`" in listed[str(value)], f"exit {value}'s row does not name {name}"


def test_the_restart_causes_name_every_disruption_the_operator_reads():
    text = the_page()["Running"]
    words = disruption_words((PACKAGE / STATES).read_text())
    assert [w for w in sorted(words) if f"`{w}`" not in text] == []


def slug(heading: str) -> str:
    """A heading's anchor, as Python-Markdown's toc extension (mkdocs' default) makes it."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_the_page_links_to_its_own_headings():
    text = PAGE.read_text()
    headings = {slug(line.lstrip("#").replace("`", "")) for line in text.splitlines()
                if re.match(r"#{1,6} ", line)}
    anchors = {t[1:] for t in LINK.findall(text) if t.startswith("#")}
    assert anchors, "the rows point to the sections they lean on"
    assert sorted(anchors - headings) == []


def test_links_stay_inside_the_docs():
    """mkdocs --strict refuses a link to a file that is not under docs/."""
    targets = [t for t in LINK.findall(PAGE.read_text()) if "://" not in t
               and not t.startswith(("#", "mailto:"))]
    assert targets, "the page links to the pages it leans on"
    broken = [t for t in targets if not (PAGE.parent / t.split("#")[0]).resolve()
              .is_relative_to(DOCS) or not (PAGE.parent / t.split("#")[0]).is_file()]
    assert broken == []


# --- the checks, shown to bite ----------------------------------------------------------------

SCRATCH = '''
GONE = "Gone"

class Builder:
    def fail(self, reason, message):
        self.cond("Failed", True, reason, message)

def guard(b, seen, why="Queued"):
    waiting = seen.blocked or "Waiting"
    b.cond("Running", False, waiting)
    b.fail(GONE, "the job is gone")
    b.cond("Admitted", False, why)
    b.event("Warning", "Oops" if seen else "Other", "said")
    b.cond(seen.type, False, "NotAType")  # a wrapper's call: not a sink

def queue_again(b):
    guard(b, None, why="Requeued")
    raise Failure("refused", "the hub said no", reason=seen.reason or "Refused")
'''


def test_the_extractor_follows_literals_constants_locals_and_parameters():
    found = reasons_in({"scratch.py": SCRATCH})
    assert found.conditions == {"Failed": {"Gone"}, "Running": {"Waiting"},
                                "Admitted": {"Queued", "Requeued"}}
    assert found.events == {"scratch.py": {"Oops", "Other"}}
    assert found.failures == {"Refused"}


def test_a_new_reason_without_a_row_fails():
    """What the brief asks for: `b.cond("Running", False, "NewReason", ...)` undocumented."""
    code = the_code()
    added = reasons_in({"scratch.py": 'def look(b):\n    b.cond("Running", False, '
                                      '"NewReason", "not on the page")\n'})
    code.reasons.conditions["Running"] |= added.conditions["Running"]
    assert undocumented(code, the_page()) == [
        "Running: reason `NewReason` has no row under ## Running"]


def test_a_row_for_a_reason_the_code_dropped_fails():
    page = the_page()
    page["Stalled"] += "| `NoLongerSet` | gone from the code | nothing |\n"
    page["Ghost"] = "| `Ghost` | no such condition | nothing |\n"
    assert stale(the_code(), page) == [
        "## Stalled: `NoLongerSet` is set nowhere in the code (nor in EXTERNAL)",
        "## Ghost lists reasons, but no condition, event or wait is called 'Ghost': "
        "['Ghost']"]


def test_a_waiting_reason_the_states_module_learns_needs_a_row():
    before = (PACKAGE / STATES).read_text()
    source = re.sub(r"^(MOUNT_REASONS = \()", r'\1"FailedMapVolume", ', before,
                    flags=re.MULTILINE)
    assert source != before
    waiting, folded = waiting_reasons(source)
    assert "FailedMapVolume" in waiting
    assert undocumented(Code(code_reasons(), waiting, folded), the_page()) == [
        f"waiting reason `FailedMapVolume` has no row under ## {WAITING}"]
