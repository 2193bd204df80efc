"""Fallback entry point: ``python -m blockgen.lm_eval ...`` (see the package docstring)."""

from blockgen.lm_eval import main

if __name__ == "__main__":
    main()
