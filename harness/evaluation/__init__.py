"""Evaluation: a model through lm-eval. The grids of sampler settings by NFE (`grids`, `paper_variants`),
`blockgen sweep` (one model load, every setting), the lm-eval model type (`lm_eval_model/`), the
generative-perplexity scorers (`scorers`, their settings in `scorer_config`, the vLLM server in
`vllm_server`) and MAUVE's cache, the demo's word-problem evaluation, and `blockgen sample`.
"""
