"""CPU per admission of the SMTP connection gate (mtaq.edge.limits.ConnectionGate) with many clients a minute.

Each of ``--admissions`` connections comes from a new client address, ``--clients-per-minute`` of them a
minute on a simulated clock (so clients leave the 60-second window at the same rate as new ones arrive, and
the gate forgets one stale client from the front of its window per admission). Prints one JSON line:
``us_per_admit`` (CPU microseconds per admit + release, this process), with the settings.

    PYTHONPATH=. .venv/bin/python bench/gate_admit.py --clients-per-minute 20000 --admissions 100000
"""

from __future__ import annotations

import argparse
import json
import time

from mtaq.edge.limits import ConnectionGate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients-per-minute", type=int, default=20_000)
    ap.add_argument("--admissions", type=int, default=100_000)
    args = ap.parse_args()
    now = [0.0]
    gate = ConnectionGate(connections_max=10**9, per_client_per_minute_max=100, clock=lambda: now[0])
    rate = args.clients_per_minute / 60.0
    start = time.process_time()
    for i in range(args.admissions):
        now[0] = i / rate
        ip = f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"
        if gate.admit(ip) is not None:
            raise SystemExit(f"gate_admit: {ip} refused")
        gate.release(ip)
    us = (time.process_time() - start) / args.admissions * 1e6
    print(json.dumps({"clients_per_minute": args.clients_per_minute, "admissions": args.admissions,
                      "us_per_admit": round(us, 2)}))


if __name__ == "__main__":
    main()
