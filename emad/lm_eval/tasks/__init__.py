"""lm-eval task configs for the embedded data (``emad_gsm8k``, ``emad_stdlib_lastword``, ``emad_stdlib_prose``).

The YAML files here are read by lm-eval (``python -m emad.lm_eval`` puts this folder on its include path);
their datasets come from :mod:`emad.lm_eval.tasks.loaders`.
"""
