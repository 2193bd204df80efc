"""Training: a model from a preset. The named configurations (`presets`), the training loop on one
process or under torchrun (`train`), and the small offline GPT-2 that scores generations offline
(`train_scorer`).
"""
