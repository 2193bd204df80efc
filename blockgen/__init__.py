"""blockgen: train and evaluate BlockGen models (block diffusion over a mixture of block sizes).

The sub-packages live in the repository's top-level folders and are mapped into this namespace by
pyproject.toml: ``blockgen.models`` (the science, no I/O), ``blockgen.harness`` (data, training,
checkpoints, evaluation plumbing) and ``blockgen.tasks`` (lm-eval tasks and the code sandbox).
"""

__version__ = "0.1.0"
