"""Reporting: result files -> summary tables -> figures -> the Markdown report.

aggregate (JSON results -> summary.csv, curves.csv), tables (summary -> the report's
tables and claim checks), figures (the workflow's figures, drawn with style's colours and
layout), fig_throughput_capacity (the estimated-speed-at-capacity figure), compare (two
summaries cell by cell), markdown (paper/results.md)."""
