"""What decides and prices an exit: readouts (logit, tuned), criteria, estimators, KV policies, strata and the
contrastive pieces — each a registry of small classes."""
