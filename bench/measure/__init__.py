"""Measurement: run one job and record what it used.

tracker (live tensor bytes by category), allocator (a model of CUDA's caching
allocator), step (building a job's model, data and fake-tensor mode), runner (one job of
each kind), capacity (largest batch / model searches), records (result files).
Imports flow one way: runner -> capacity -> step -> tracker, allocator."""
