"""Reproducible experiments and measurements (not part of the installed package)."""
