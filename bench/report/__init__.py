"""Reporting: result files -> summary tables -> figures -> the Markdown report.

aggregate (JSON results -> summary.csv, curves.csv), tables (summary -> the report's
tables and claim checks), figures (one module per figure), markdown (paper/results.md)."""
