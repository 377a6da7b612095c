"""Calibration: mergeable statistics, the teacher-forcing pass, smoothing to a profile, and fitting readouts and
estimators."""
