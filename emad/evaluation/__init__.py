"""Evaluation: operating points, the run of one point over its tasks, run files, and risk control."""
