"""Process entry points: what a broker, consumer or producer process runs (signals, logging,
wiring of configuration). The CLI and the launcher start processes through these."""
