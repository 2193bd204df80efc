"""Fallback entry point: ``python -m blockgen.lm_eval ...``."""
