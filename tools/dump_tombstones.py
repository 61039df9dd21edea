#!/usr/bin/env python3
"""Thin wrapper: `pipeline tools dump-tombstones` (see `pipeline tools dump-tombstones --help`)."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    main(["tools", "dump-tombstones", *sys.argv[1:]])
