#!/usr/bin/env python3
"""Thin wrapper: `pipeline tools dump-segment` (see `pipeline tools dump-segment --help`)."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    main(["tools", "dump-segment", *sys.argv[1:]])
