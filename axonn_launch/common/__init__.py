"""Torch-free pieces shared by the login node and the job: the grid, model and job specs, machine
profiles, the rules, the job directory.
"""
