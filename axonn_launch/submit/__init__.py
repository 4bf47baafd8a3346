"""Turning validated settings into a job: the pipeline, the batch script, Slurm and local runs,
sweeps and resubmission.
"""
