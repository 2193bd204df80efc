"""The lm-eval model type ``blockgen`` (``lm_eval --model blockgen``), the only code that knows lm-eval's
request types, in four parts: its ``--model_args`` and a sampler setting to and from them
(`arguments`), the log-sum-exp bound of scored windows (`scoring`) and its Monte Carlo error
(`mc_error`), what a run used as the results JSON reports it (`usage`), and the model itself, which
answers lm-eval's requests (`model`: `BlockGenLM`, registered when that module is imported)."""
