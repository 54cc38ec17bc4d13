"""The crash-state explorer, long run: every crash state of every workload within wider bounds (issue 31).

``make test`` runs a bounded seed (tests/test_explorer.py); this runs :func:`mtaq.testing.explorer.explore`
with the bounds given on the command line (see :class:`mtaq.testing.explorer.Bounds`; the defaults here go
two crashes deep from every first crash, with every subset of up to 8 unsynced changes in the workload's
run and up to 3 after it, torn writes, kills, and crash points at every operation of the later runs too).

It prints ONE JSON line on stdout::

    {"states": N, "duplicates": N, "per_workload": {...}, "violations": N, "by_kind": {"workload:kind": N},
     "examples": ["the shortest history of each kind, replayable", ...], "seconds": S, "truncated": false,
     "bounds": {...}}

and exits 1 when there are violations. ``--states-max`` stops each workload after that many distinct
states (then ``truncated`` is true). Each example names its workload and crashes; replay one with
``mtaq.testing.explorer.replay(workload, path)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from mtaq.testing.explorer import WORKLOADS, Bounds, ExploreReport, explore


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default: all)")
    ap.add_argument("--crashes", type=int, default=2, help="crashes per history (default 2)")
    ap.add_argument("--all-subsets-max", type=int, default=8,
                    help="every subset of the unsynced changes up to this many, in the workload's run (default 8)")
    ap.add_argument("--later-all-subsets-max", type=int, default=3, help="the same in later runs (default 3)")
    ap.add_argument("--no-torn", action="store_true", help="no torn writes")
    ap.add_argument("--no-kill", action="store_true", help="power cuts only, no kill -9")
    ap.add_argument("--later-points", choices=("start", "all"), default="all",
                    help="crash points of runs after a crash: their start only, or every operation (default)")
    ap.add_argument("--deepen", choices=("all", "kill", "kill-unsynced", "unsynced", "holes"), default="all",
                    help="which crashes get a further crash (default all)")
    ap.add_argument("--later-receive", action="store_true",
                    help="each run after a crash acknowledges a message between Log.open and its recovery")
    ap.add_argument("--states-max", type=int, default=0,
                    help="stop each workload after this many states (0: no limit)")
    args = ap.parse_args(argv)
    bounds = Bounds(
        crashes=args.crashes,
        all_subsets_max=args.all_subsets_max,
        later_all_subsets_max=args.later_all_subsets_max,
        torn=not args.no_torn,
        kill=not args.no_kill,
        later_points=args.later_points,
        deepen=args.deepen,
        states_max=args.states_max,
        later_receive=args.later_receive,
    )
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    total = ExploreReport()
    for name in names:  # one at a time: --states-max bounds each workload, not the whole run
        r = explore([name], bounds)
        total.states += r.states
        total.duplicates += r.duplicates
        total.per_workload.update(r.per_workload)
        total.truncated = total.truncated or r.truncated
        total.seconds += r.seconds
        for examples in r.examples.values():
            for v in examples:
                total.add(v)
        for key, n in r.violations.items():
            total.violations[key] += n - len(r.examples.get(key, []))
    out = total.summary()
    out["bounds"] = dataclasses.asdict(bounds)
    print(json.dumps(out))
    return 1 if total.total() else 0


if __name__ == "__main__":
    sys.exit(main())
