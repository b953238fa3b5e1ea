"""One module per memory-reduction method; see bench/method.py for the contract and
methods/_template.py for a starting point. Every module here is found automatically."""
