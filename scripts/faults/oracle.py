"""The oracle of the SIGKILL campaign (scripts/faults/reliability.py): what a trial's children recorded,
what a resume after the kill was allowed to load, and the outcome class. Pure: no torch.

Each saver rank appends one line per event to `events_rank_{r}.log` (written with os.write, so a
SIGKILL loses nothing already written; hash lines are also fsynced):

    <monotonic seconds> <kind> <step> [<detail>]

kinds: ready, train, hash (detail: per-content hashes as json), save-begin, save-returned,
committed, and phase markers from inside the save (write:model, dcp-write, manifest, retention,
tracker, ...). The parent adds the kill time.

"Committed" is the point after which a crash must not lose the step:
- sync modes (verl's default, quickstart, incremental sync): the trainer's `_save_checkpoint`
  returned, i.e. every rank's save returned (the worker-group call waits for all ranks, as Ray's
  does) and the tracker file names the step. The rank-0 `committed N` line is written right after.
- incremental async: the tracker was moved to N (slimckpt's commit watcher, after the manifest).
A kill between the commit point and its line leaves the step committed without the line, so a
resume may also load any LATER step whose save had begun, provided it loads that step's state
exactly (which proves the commit point was passed: verl writes the tracker after every save
returned, slimckpt loads only a step with a complete manifest).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

GOOD = ("exact", "clean-start")
BAD = ("lost-committed", "crash-on-load", "loaded-wrong-state", "loaded-partial")
OUTCOMES = GOOD + BAD

MERGE_GOOD = ("absent", "complete-verified")
MERGE_BAD = ("looks-complete-but-broken", "rerun-failed")


@dataclass
class Event:
    t: float
    kind: str
    step: int
    detail: str = ""


def parse_events(text: str) -> list[Event]:
    """Lines of an events log; a torn last line (the kill hit a write) is dropped."""
    out = []
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3:
            continue
        try:
            out.append(Event(float(parts[0]), parts[1], int(parts[2]), parts[3] if len(parts) > 3 else ""))
        except ValueError:
            continue
    return out


@dataclass
class Record:
    """What the saver ranks wrote before the kill."""

    committed: list[int] = field(default_factory=list)
    begun: list[int] = field(default_factory=list)
    hashes: dict[int, dict[int, dict[str, str]]] = field(default_factory=dict)  # rank -> step -> content -> hex

    @property
    def last_committed(self) -> int | None:
        return max(self.committed) if self.committed else None


def build_record(events_by_rank: dict[int, list[Event]]) -> Record:
    rec = Record()
    for rank, events in events_by_rank.items():
        rec.hashes[rank] = {}
        for ev in events:
            if ev.kind == "hash":
                try:
                    rec.hashes[rank][ev.step] = json.loads(ev.detail)
                except ValueError:
                    continue
            if rank == 0 and ev.kind == "committed":
                rec.committed.append(ev.step)
            if rank == 0 and ev.kind == "save-begin":
                rec.begun.append(ev.step)
    return rec


def allowed_steps(rec: Record) -> set[int]:
    """Steps a resume may load: the last committed one, or a later one whose save had begun."""
    last = rec.last_committed
    out = {s for s in rec.begun if last is None or s > last}
    if last is not None:
        out.add(last)
    return out


@dataclass
class Resume:
    """What the resume checker's ranks reported."""

    step: int | None  # global_steps after _load_checkpoint; 0 = started clean
    error: str | None
    hashes: dict[int, dict[str, str]]  # rank -> content -> hex of the loaded state
    compared: list[str]  # contents the mode loads (model / optim / extra)


def classify(rec: Record, res: Resume) -> tuple[str, str]:
    """(outcome, why) for one kill."""
    last = rec.last_committed
    if res.error is not None:
        return "crash-on-load", res.error
    if not res.step:
        if last is None:
            return "clean-start", "nothing was committed before the kill"
        return "lost-committed", f"started clean although step {last} was committed"
    step = res.step
    if last is not None and step < last:
        return "lost-committed", f"loaded step {step}, but step {last} was committed"
    if step not in allowed_steps(rec):
        return "loaded-wrong-state", f"loaded step {step}, which no save of this trial began"
    diffs = []
    for rank, loaded in sorted(res.hashes.items()):
        saved = rec.hashes.get(rank, {}).get(step)
        if saved is None:
            diffs.append(f"rank {rank}: no recorded state for step {step}")
            continue
        diffs += [f"rank {rank} {c}" for c in res.compared if saved.get(c) != loaded.get(c)]
    if len(res.hashes) < len(rec.hashes):
        diffs.append(f"only {len(res.hashes)} of {len(rec.hashes)} ranks reported")
    if diffs:
        kind = "loaded-wrong-state" if step in rec.committed else "loaded-partial"
        return kind, f"step {step}: state differs from the recorded one ({', '.join(diffs[:4])})"
    if step == last:
        return "exact", f"step {step}, the last committed"
    return "exact", f"step {step} (its commit point passed just before the kill)"


def phase_at(events: list[Event], t_kill: float) -> str:
    """The last event a rank wrote before the kill: where the kill landed."""
    before = [e for e in events if e.t <= t_kill]
    if not before:
        return "setup"
    return before[-1].kind


def classify_merge(target_exists: bool, verified: bool, matches_reference: bool, rerun_ok: bool) -> str:
    """A killed merge: the target is absent, or complete and verifying; a rerun then succeeds."""
    if target_exists and not (verified and matches_reference):
        return "looks-complete-but-broken"
    if not rerun_ok:
        return "rerun-failed"
    return "complete-verified" if target_exists else "absent"


def tally(outcomes: list[str]) -> dict[str, int]:
    counts = Counter(outcomes)
    return {k: counts[k] for k in sorted(counts)}


def quantiles(values: list[float], qs: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)) -> list[float]:
    if not values:
        return []
    v = sorted(values)
    return [v[min(len(v) - 1, int(round(q * (len(v) - 1))))] for q in qs]
