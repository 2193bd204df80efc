"""Data: the text a model trains and is evaluated on. The sources (generated word problems, TinyGSM,
OpenWebText and its offline twin, the held-out split of each), the memory-mapped cache training
reads (`prepare`), and the offline word-problem generator (`wordproblems`, a template catalogue).
"""
