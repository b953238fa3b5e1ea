"""membench: the job (job), the config and its plan (suite), the method contract (method),
models and data (models, data), measurement (measure/), reporting (report/), the
`membench` command (__main__: `membench --help` lists its subcommands)."""

import logging as _logging

# transformers imports torchao whenever it is installed; torchao's import then logs a
# warning per CUDA kernel library a CPU build cannot load, and torch one per enum torchao
# registers the old way; bitsandbytes (under galore-torch) one for a CPU kernel it would
# fetch from the hub: lines of noise in every job log and in `membench fit`, none of them
# about the run. Their errors still show.
for _name in ("torchao", "torch.utils._pytree", "bitsandbytes"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
