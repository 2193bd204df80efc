"""Costs: what a run will take before it runs. Work counted per evaluation setting and priced
(`eval_cost`), the measured rates of a device (`rates`, with the stored H100 figures in
`measured_rates/`), and the cost of training (`train_cost`).
"""
