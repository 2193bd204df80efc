"""`blockgen gpu-check` (`make gpu-check`): what a user with one GPU runs first, in under 8 minutes, one
JSON summary and one table; on a CPU the same stages at micro size. `config` says what the check runs
(the stages, their shares of the time budget, the two scales, `GpuCheckConfig`, a stage's `Budget`),
`check` runs them (`run_gpu_check`), the stages live in `train_stage`, `generate_stage` and
`command_stages` (ddp, lm_eval and scorers: the stages that start other programs), `summary` judges each
stage, prints the table and writes the rates file, and `timing` holds the device-side helpers the stages
share (harness/cli.py mounts the command).
"""
