#!/usr/bin/env python3
"""Run the `beamserve` CLI from the source tree on the device machine (nothing is installed
there; scripts/device-kv-bench.sh puts the tree on PYTHONPATH)."""

import sys

if __name__ == "__main__":
    from beamserve.cli import main

    sys.exit(main(sys.argv[1:]))
