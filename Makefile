# Regenerate the README's figures (docs/figures/*.png) from the logged results only:
# results/*.json and docs/figures/*.json; nothing is trained or benchmarked.
# A figure whose data file is missing is reported with the command that produces it.
PYTHON ?= python

.PHONY: figures
figures:
	$(PYTHON) -m experiments.figures --all
