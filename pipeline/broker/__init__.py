"""The broker: lane policy, packing, shape selection and the dispatch loop (SPEC §2-§6)."""
