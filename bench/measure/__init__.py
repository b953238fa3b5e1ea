"""Measurement: run one job and record what it used.

tracker (live tensor bytes by category), allocator (a model of CUDA's caching
allocator), step (building a job's model, data and fake-tensor mode), kinds (what each
kind of job measures), timing (interleaved rounds beside a baseline), cost (FLOPs and
bytes per phase), runner (one job, or a panel of throughput jobs, to a result record),
capacity (largest batch / model searches), records (result files and provenance).
Imports flow one way: runner -> capacity -> kinds -> step -> tracker, allocator."""
