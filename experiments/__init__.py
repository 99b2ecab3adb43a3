"""Thin scripts: the main job, ablations, benchmarks and figures (`python -m experiments.<name>`)."""
