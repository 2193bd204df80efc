"""The harness: everything between the network (`models/`) and lm-eval's tasks (`tasks/`), in wings
named for what they hold: `checkpoints/` (a model on disk), `data/` (text and its cache), `training/`,
`evaluation/` (lm-eval, the sweep, scorers, sampling), `costs/` (what a run will take), `reports/`
(leaderboards, plots, CI checks) and `runtime/` (devices, precision, progress). At the top: the one
command line (`cli`) and the commands that cross wings (`demo`, `gpu_check`).
"""
