#!/usr/bin/env python3
"""Thin wrapper: `pipeline tools verify` (see `pipeline tools verify --help`)."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    main(["tools", "verify", *sys.argv[1:]])
