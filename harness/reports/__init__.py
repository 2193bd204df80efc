"""Reports: results turned into something to read or check. Leaderboard rows and tables, paired
comparisons, plots, the static HTML page, the CI regression checks (one command, `blockgen regression`,
against a leaderboard with tolerances or stored per-problem outcomes) and the findings across training runs.
"""
