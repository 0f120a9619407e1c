"""The host⇄device link, measured: pinned host→device, device→host and both at once, in GB/s.

    python benchmarks/link.py --device cuda --jsonl rows.jsonl     # the GPU check's first timed part
    python benchmarks/link.py --device cpu --bytes 16MiB          # the dry run: the CPU as "device"

Writes one ``part: link`` row (``h2d_gb_s``, ``d2h_gb_s``, ``bidir_gb_s``); the planner takes
the slower direction with ``--link-bandwidth`` (or measures it itself on this machine's GPU).
"""

from __future__ import annotations

import argparse
import json

import torch

from hybridtrain.profiling.link_bandwidth import link_bandwidth
from hybridtrain.units import parse_bytes


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Measure the link and print (and append to ``--jsonl``) its row."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bytes", default="1GiB", help="bytes per copy (default 1GiB)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes; the fastest counts")
    parser.add_argument("--jsonl", default=None, help="append the row to this file")
    args = parser.parse_args(argv)
    found = link_bandwidth(args.device, parse_bytes(args.bytes), args.repeats)
    device = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu"
    row = {"part": "link", "device": device, "status": "ok", "repeats": args.repeats, **found.as_row()}
    print(json.dumps(row), flush=True)
    if args.jsonl:
        with open(args.jsonl, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return row


if __name__ == "__main__":
    main()
