"""docs/troubleshooting.md's list of every one-line refusal slimckpt can print, read from the code.

    python -m scripts.troubleshooting            # rewrite the list in docs/troubleshooting.md
    python -m scripts.troubleshooting --check    # exit 1 if the list is not the code's (tests/scripts runs it)

A refusal is the message of one of slimckpt's exception classes (every class deriving from
`slimckpt.SlimckptError`, found in the source) where the code builds one: `raise X(f"...")`,
`return X(...)`, a message assigned to a name first and raised with it, the `super().__init__(...)`
of a class that composes its own, and a `raise SystemExit("...")` that stops a run. Each is shown as
its template: what the code fills in at run time is `<name>`, named after the expression. A message
re-raised from another (`X(str(exc))`) is the other's, listed where it is built. The fix is the part
after the last `; ` (or after the last `: ` where an instruction follows), as the messages are written.

The list sits between `<!-- refusals:begin -->` and `<!-- refusals:end -->`; the rest of the page is
written by hand.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from scripts.bench.save_report import write_section  # one way to replace a marked section of a page

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "patches" / "slimckpt"
DOC = REPO / "docs" / "troubleshooting.md"
BEGIN, END = "<!-- refusals:begin -->", "<!-- refusals:end -->"
ROOT = "SlimckptError"
REGENERATE = "python -m scripts.troubleshooting"

# calls that only format a value: the placeholder is named after what they format
FORMATTERS = frozenset(
    {"str", "repr", "len", "int", "float", "round", "sorted", "list", "tuple", "set", "abs", "max", "min", "sum"}
    | {"type", "human", "one_line", "hex", "bool", "basename"}
)
STR_METHODS = frozenset({"strip", "rstrip", "lstrip", "removeprefix", "removesuffix", "lower", "upper", "splitlines"})
# a fix starts with one of these after the last ': ' when the message has no '; '
FIX_VERBS = (
    "pass|pip|use|set|choose|install|reinstall|re-copy|copy|merge|convert|create|add|drop|give|delete|remove|start|"
    "run|rerun|fix|change|resume|write|load|point|free|retry|check|grant|report|keep|restart|unset|export|wait"
)
FIX_AFTER_COLON = re.compile(rf": (?=(?:{FIX_VERBS})\b)")
# classes whose message is only ever a part of another's line (the reason in its parentheses), listed there
QUOTED = {
    "NotATorchFile": "engine/verl_sources.py, convert/source.py: '... not a readable torch checkpoint (<reason>)'",
    "NeedsVerlMerger": "merge/verl_fallback.py: 'slimckpt's streaming merge does not handle this checkpoint (<why>) ...'",
    "NothingToDrop": "save/retention/prune.py logs it: 'retention left <path> as it is: <why>'",
    "AssignError": "save/export/direct.py: 'HF export of <local_path>: <line>'",
    "StoreSilent": "dist/heartbeat.py: a rank that stopped answering is named by RankLost's line",
}
# a message that ends in (or starts with) one of these quotes another refusal whole: that one's fix applies
QUOTING = re.compile(r"<(?:line|exc|e|error|first|one_line)>\)?$|^<(?:line|exc)> \(")


@dataclass(frozen=True, order=True)
class Refusal:
    module: str  # the file under patches/slimckpt/, e.g. merge/pipeline.py
    message: str  # the template, `<name>` where the code fills a value in
    kind: str  # the exception class (or SystemExit)

    @property
    def fix(self) -> str:
        return split_fix(self.message)[1]


QUOTED_FIX = "the fix the quoted message names"


def split_fix(message: str) -> tuple[str, str]:
    """(what went wrong, what to do): at the last '; ', else at the last ': ' an instruction follows;
    a message that ends quoting another's is fixed by that one's fix."""
    if QUOTING.search(message):
        return message, QUOTED_FIX
    if "; " in message:
        what, fix = message.rsplit("; ", 1)
        return what, fix
    found = list(FIX_AFTER_COLON.finditer(message))
    if found:
        return message[: found[-1].start()], message[found[-1].end() :]
    return message, ""


def exception_classes(pkg: Path) -> set[str]:
    """The names of every class deriving (through any chain of ours) from SlimckptError."""
    bases: dict[str, list[str]] = {}
    for path in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
    ours = {ROOT}
    while more := {n for n, b in bases.items() if n not in ours and ours.intersection(b)}:
        ours |= more
    return ours


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else ""


def placeholder(expr: ast.expr) -> str:
    """The name a value filled in at run time is shown by: `{args.step_dir}` -> step_dir,
    `{type(exc).__name__}` -> exc, `{human(need)}` -> need."""
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return placeholder(expr.value) if expr.attr == "__name__" else expr.attr
    if isinstance(expr, ast.Subscript):
        return placeholder(expr.value)
    if isinstance(expr, ast.Constant):
        return str(expr.value)
    if isinstance(expr, ast.Call):
        name = _call_name(expr.func)
        if name == "getattr" and len(expr.args) > 1 and isinstance(expr.args[1], ast.Constant):
            return str(expr.args[1].value)
        if isinstance(expr.func, ast.Attribute) and name in STR_METHODS:
            return placeholder(expr.func.value)
        if (name in FORMATTERS or name == "join" or name.startswith("_")) and expr.args:
            return placeholder(expr.args[0])
        return name or "value"
    if isinstance(expr, ast.BinOp):
        return placeholder(expr.left)
    if isinstance(expr, ast.IfExp):
        return placeholder(expr.body)
    if isinstance(expr, (ast.GeneratorExp, ast.ListComp, ast.SetComp)):
        return placeholder(expr.elt)
    return "value"


class Templates:
    """Message templates of one module: string expressions rendered with `<name>` placeholders, a
    module-level string constant (a shared hint) written out, a local name followed to what it was given."""

    def __init__(self, tree: ast.Module) -> None:
        self.constants: dict[str, ast.expr] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                self.constants[node.targets[0].id] = node.value
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node

    def _function(self, node: ast.AST) -> ast.AST | None:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return None

    def _value(self, expr: ast.expr, depth: int) -> list[str]:
        """What a `{name}` inside a message shows: a module's string constant written out, else `<name>`."""
        if isinstance(expr, ast.Name) and expr.id in self.constants and depth < 3:
            text = self.render(self.constants[expr.id], expr, depth + 1)
            if len(text) == 1:
                return text
        if isinstance(expr, ast.IfExp):  # `{' text' if c else ''}`: an optional part, shown in brackets
            sides = self.render(expr.body, expr, depth + 1) + self.render(expr.orelse, expr, depth + 1)
            if len(sides) == 2 and "" in sides:
                return [f"[{max(sides)}]"]
        return [f"<{placeholder(expr)}>"]

    def render(self, expr: ast.expr, at: ast.AST, depth: int = 0) -> list[str]:
        """Every message `expr` can be (both sides of an `a if c else b`); [] if it is not a string."""
        if isinstance(expr, ast.Constant):
            return [expr.value] if isinstance(expr.value, str) else []
        if isinstance(expr, ast.JoinedStr):
            texts = [""]
            for part in expr.values:
                if isinstance(part, ast.Constant):
                    texts = [t + str(part.value) for t in texts]
                else:
                    texts = [t + v for t in texts for v in self._value(part.value, depth)]
            return texts
        if isinstance(expr, ast.IfExp):
            return self.render(expr.body, at, depth) + self.render(expr.orelse, at, depth)
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            left, right = self.render(expr.left, at, depth), self.render(expr.right, at, depth)
            if not left and not right:
                return []
            left = left or self._value(expr.left, depth)
            right = right or self._value(expr.right, depth)
            return [a + b for a in left for b in right]
        if isinstance(expr, ast.Name) and depth < 3:
            return self._assigned(expr.id, at, depth)
        return []

    def _assigned(self, name: str, at: ast.AST, depth: int) -> list[str]:
        """The messages a local `name` was given in the function around `at`, before it."""
        scope = self._function(at)
        if scope is None:
            return []
        found: list[str] = []
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and getattr(node, "lineno", 0) <= getattr(at, "lineno", 0):
                if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    found += self.render(node.value, node, depth + 1)
        return found


def self_composed(pkg: Path, ours: set[str]) -> set[str]:
    """Our classes whose `__init__` composes the message from its arguments: their template is there,
    and the arguments at a call site are not messages."""
    found = set()
    for path in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name in ours:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        found.add(node.name)
    return found


def refusals(pkg: Path = PKG) -> list[Refusal]:
    ours = exception_classes(pkg) - set(QUOTED)
    composed = self_composed(pkg, ours)
    found: set[Refusal] = set()
    for path in sorted(pkg.rglob("*.py")):
        tree = ast.parse(path.read_text())
        templates = Templates(tree)
        module = str(path.relative_to(pkg))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            kind = _call_name(node.func)
            if kind == "__init__" and isinstance(node.func, ast.Attribute):
                cls = templates.parents.get(templates._function(node))
                if not (isinstance(cls, ast.ClassDef) and cls.name in ours):
                    continue
                kind = cls.name
            elif kind == "SystemExit":
                if not isinstance(templates.parents.get(node), ast.Raise):
                    continue
            elif kind not in ours or kind in composed:
                continue
            for arg in node.args:
                messages = templates.render(arg, node)
                if messages:
                    found.update(Refusal(module, " ".join(m.split()), kind) for m in messages if _is_line(m))
                    break
    return sorted(found)


def _is_line(message: str) -> bool:
    """A line a user reads, not a fragment another message quotes (`tensor`, `no manifest`): it names
    what went wrong and where or how, in more than two words."""
    return len(message.split()) > 2


def _cell(text: str) -> str:
    text = text.replace("|", "\\|")
    ticks = "``" if "`" in text else "`"
    pad = " " if ticks == "``" else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def render_block(found: list[Refusal]) -> str:
    lines = [
        BEGIN,
        f"<!-- written by `{REGENERATE}` from the code; do not edit by hand -->",
        "",
        f"{len(found)} refusals. `<name>`: filled in at run time. Where: the module under `patches/slimckpt/`.",
        "",
        "| where | refusal | fix |",
        "|---|---|---|",
    ]
    for r in found:
        what, fix = split_fix(r.message)
        lines.append(f"| `{r.module}` | {_cell(what)} | {_cell(fix) if fix else '(none yet)'} |")
    lines.append(END)
    return "\n".join(lines) + "\n"


def current_block(doc: Path) -> str | None:
    text = doc.read_text() if doc.exists() else ""
    if BEGIN not in text or END not in text:
        return None
    return BEGIN + text.split(BEGIN, 1)[1].split(END, 1)[0] + END + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"{REGENERATE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the page's list is not the code's; write nothing")
    p.add_argument("--doc", default=str(DOC), help="the page (default: docs/troubleshooting.md)")
    args = p.parse_args(argv)
    doc = Path(args.doc)
    block = render_block(refusals())
    if args.check:
        if current_block(doc) != block:
            print(f"{doc}: its list of refusals is not the code's; run `{REGENERATE}` and commit it", file=sys.stderr)
            return 1
        return 0
    write_section(block, doc)
    print(f"{doc}: {block.count(chr(10) + '| `')} refusals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
