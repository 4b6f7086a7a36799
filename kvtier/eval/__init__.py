"""The evaluation: routing policies replayed on simulated HiCache clusters, beside the oracle and round robin."""
