"""Checkpoints: what a trained model is on disk and where it comes from. The checkpoint folder (Hugging
Face layout, two crash-safe slots), the tokenizer, the Hugging Face hub (every download and its
offline errors), and the paper's released checkpoints converted into the same folder. Imports only
`models/` and itself, so anything may load a model without pulling in training or evaluation.
"""
