"""scripts/troubleshooting.py: docs/troubleshooting.md lists every one-line refusal the code builds,
with its fix, and the list is the code's (a new refusal without its line fails here)."""

from __future__ import annotations

from scripts import troubleshooting as ts
from tests.helpers.launch import REPO


def test_the_page_lists_every_refusal_in_the_code(capsys):
    stale = ts.main(["--check"])
    assert stale == 0, f"docs/troubleshooting.md is stale: run `{ts.REGENERATE}` and commit it"
    found = ts.refusals()
    assert len(found) > 150  # the walk sees the package's messages
    modules = {r.module.split("/")[0] for r in found}
    assert {"convert", "merge", "engine", "storage", "verl", "resume"} <= modules
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    assert text.startswith("# Troubleshooting") and text.index("## Every refusal") < text.index(ts.BEGIN)


def test_a_new_refusal_makes_the_page_stale(tmp_path, monkeypatch):
    pkg = tmp_path / "slimckpt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("class SlimckptError(Exception):\n    pass\n")
    (pkg / "a.py").write_text(
        "from slimckpt import SlimckptError\n"
        "HINT = 'pass --overwrite'\n"
        "class AError(SlimckptError, ValueError):\n    pass\n"
        "class Own(SlimckptError):\n"
        "    def __init__(self, path):\n"
        "        super().__init__(f'{path}: refused, which nothing writes; {HINT}')\n"
        "def f(args, exc, n):\n"
        "    if n:\n"
        "        raise AError(f'{args.target_dir} is not empty; {HINT} to replace it')\n"
        "    line = f'rank {n} of {len(args.ranks)} stopped: restart the job'\n"
        "    raise AError(line if n > 1 else 'one rank, nothing to stop')\n"
        "def g(exc):\n"
        "    raise AError(str(exc))  # a re-raise: the message is listed where it is built\n"
        "def h(path):\n"
        "    raise Own(path)  # its template is in __init__\n"
        "def i(exc):\n"
        "    raise SystemExit(f'slimckpt: {type(exc).__name__} stopped the run: {exc}')\n"
    )
    found = ts.refusals(pkg)
    assert [(r.module, r.message, r.fix) for r in found] == [
        ("a.py", "<path>: refused, which nothing writes; pass --overwrite", "pass --overwrite"),
        ("a.py", "<target_dir> is not empty; pass --overwrite to replace it", "pass --overwrite to replace it"),
        ("a.py", "one rank, nothing to stop", ""),
        ("a.py", "rank <n> of <ranks> stopped: restart the job", "restart the job"),
        ("a.py", "slimckpt: <exc> stopped the run: <exc>", ts.QUOTED_FIX),
    ]
    doc = tmp_path / "troubleshooting.md"
    doc.write_text(f"# Troubleshooting\n\nBy hand.\n\n{ts.BEGIN}\n{ts.END}\n")
    monkeypatch.setattr(ts, "refusals", lambda: found)
    assert ts.main(["--check", "--doc", str(doc)]) == 1
    assert ts.main(["--doc", str(doc)]) == 0 and ts.main(["--check", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Troubleshooting\n\nBy hand.\n") and text.count("| `a.py` |") == 5
    assert "| `one rank, nothing to stop` | (none yet) |" in text


def test_the_fix_is_the_messages_last_part():
    assert ts.split_fix("x: y; pass --a; or --b") == ("x: y; pass --a", "or --b")
    assert ts.split_fix("size '5X': use one of TB, GB") == ("size '5X'", "use one of TB, GB")
    assert ts.split_fix("x: the store is gone") == ("x: the store is gone", "")
    assert ts.split_fix("HF export of <p>: <line>")[1] == ts.QUOTED_FIX
