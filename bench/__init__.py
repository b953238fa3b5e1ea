"""membench harness: models, data, memory and speed measurement, the runner, aggregation,
figures. `python -m bench --help` runs one job."""
