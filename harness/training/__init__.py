"""Training: a model from a preset. The settings of a run (`train_config`), the named configurations
(`presets`), the training loop on one process or under torchrun (`train`) with its run directory
across restarts and ranks (`run_directory`), its stop on a signal (`stop_signals`) and its FLOPs and
memory (`flops_memory`), and the small offline GPT-2 that scores generations offline (`train_scorer`).
"""
