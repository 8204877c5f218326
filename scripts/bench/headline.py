"""README's measured rows of `make bench` and the same-box peers: a save with an HF export and a merge at
1.03B against verl 0.9.1, and the merge beside the best peer that ran on this host. Reads the committed
bench JSONs; measures nothing, so a figure in README has one source, its JSON.

    python -m scripts.bench.headline                  # rewrites README.md's bench-headline block
    python -m scripts.bench.headline --readme ''      # prints the block
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import median

from scripts.bench.save_report import write_section

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
BEGIN, END = "<!-- bench-headline:begin -->", "<!-- bench-headline:end -->"
MiB = 2**20
SIZE = "1b"  # the largest size `make bench` measures verl's hf_model save and merger at
SAVE_ANCHOR = "save-inside-verl-fsdp2-world-size-2-verl-091s-fsdpcheckpointmanager"
MERGE_ANCHOR = "merge-fsdp2-checkpoint-world-size-2-to-hugging-face-safetensors-bf16"
PEERS_ANCHOR = "same-box-same-weights-the-merge-against-its-peers"
OURS = "slimckpt merge"


def _row(rows: list[dict], **match: str) -> dict:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if not found:
        raise SystemExit(f"[headline] no row {match} in the bench JSON: rerun its bench or fix the JSON")
    return found[0]


def _mem_time(mib: float, seconds: float) -> str:
    return f"{mib:,.0f} MiB, {seconds:.1f} s"


def best_peer(peers: dict) -> dict | None:
    """The peer (not slimckpt, not verl) that ran and wrote equal tensors with the lowest median wall."""
    ran = [
        r
        for r in peers["rows"]
        if not r["tool"].startswith("slimckpt") and r.get("walls") and (r.get("check") or {}).get("ok", True)
    ]
    return min(ran, key=lambda r: median(r["walls"]), default=None)


def rows(save: dict, merge: dict, peers: dict, peers_same_size: dict) -> list[str]:
    """The table's rows, each figure read from its JSON."""
    verl_save = _row(save["rows"], size=SIZE, mode="verl")
    ours_save = _row(save["rows"], size=SIZE, mode="incremental")
    verl_merge = _row(merge["rows"], size=SIZE, tool="verl 0.9.1, warm")
    ours_merge = _row(merge["rows"], size=SIZE, tool="slimckpt")
    params = verl_save["params"] / 1e9
    out = [
        f"| save with a Hugging Face export, {params:.2f}B model, 2 ranks: rank 0's extra host memory, time "
        f"([BENCHMARKS.md](BENCHMARKS.md#{SAVE_ANCHOR})) "
        f"| {_mem_time(verl_save['peak_extra'] / MiB, verl_save['wall_s'])} (`hf_model`) "
        f"| {_mem_time(ours_save['peak_extra'] / MiB, ours_save['wall_s'])} (`+recipe=incremental`) |",
        f"| merge a {verl_merge['params'] / 1e9:.2f}B checkpoint to safetensors: peak memory, time "
        f"([BENCHMARKS.md](BENCHMARKS.md#{MERGE_ANCHOR})) "
        f"| {_mem_time(verl_merge['peak_rss_anon'] / MiB, verl_merge['wall_s'])} "
        f"| {_mem_time(ours_merge['peak_rss_anon'] / MiB, ours_merge['wall_s'])} |",
    ]
    peer = best_peer(peers)
    if peer is not None:
        ours = _row(peers_same_size["rows"], tool=OURS)
        size = peers["inputs"]["dcp"]["params"] / 1e9
        out.append(
            f"| merge a {size:.2f}B checkpoint: the fastest other tool that ran here, on its own save "
            f"([BENCHMARKS.md](BENCHMARKS.md#{PEERS_ANCHOR})): peak memory, time "
            f"| {_mem_time(max(peer['peaks']) / MiB, median(peer['walls']))} ({peer['tool']}) "
            f"| {_mem_time(max(ours['peaks']) / MiB, median(ours['walls']))} |"
        )
    return out


def block(save: dict, merge: dict, peers: dict, peers_same_size: dict) -> str:
    dates = " and ".join(dict.fromkeys((merge["date"], save["meta"]["date"])))  # one date when both ran that day
    head = (
        f"Measured on one {save['meta']['machine']} host (`make bench`, {dates}; "
        f"the peers' rows `make bench-scale`, {peers['date'][:10]}):"
    )
    table = [
        "| | verl 0.9.1, or the other tool | slimckpt |",
        "|---|---|---|",
        *rows(save, merge, peers, peers_same_size),
    ]
    return "\n".join([BEGIN, head, "", *table, END]) + "\n"


def load(docs: Path) -> tuple[dict, dict, dict, dict]:
    names = ("bench_save.json", "bench_merge.json", "bench_peers.json", "bench_peers_3.6b.json")
    return tuple(json.loads((docs / n).read_text()) for n in names)  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", default=str(DOCS), help="folder holding the bench JSONs")
    p.add_argument("--readme", default=str(REPO / "README.md"), help="README whose block to rewrite; '' prints it")
    args = p.parse_args(argv)
    text = block(*load(Path(args.docs)))
    if not args.readme:
        print(text, end="")
        return 0
    readme = Path(args.readme)
    if BEGIN not in readme.read_text():
        raise SystemExit(f"[headline] {readme} has no {BEGIN} ... {END} block: add the two markers where the rows go")
    write_section(text, readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
