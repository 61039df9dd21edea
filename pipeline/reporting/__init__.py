"""What a run says about itself: accounting by item id, the report, live progress, plots, metrics."""
