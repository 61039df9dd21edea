"""Offline analysis of workloads: shapes, shared prefixes and the prefix-reuse bound
(`pipeline tools analyze`), computed with the sim engine's block hash and prefix cache."""
