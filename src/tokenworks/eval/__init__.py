"""Measurements of what a model computes (not how fast): perplexity on a text."""
