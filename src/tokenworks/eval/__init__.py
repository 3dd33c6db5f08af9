"""Measurements of what a model computes (not how fast): perplexity on a text, and
lm-evaluation-harness's tasks in process (harness.py)."""
