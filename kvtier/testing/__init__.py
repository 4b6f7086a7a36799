"""Robustness harnesses: the fuzz table of wire decoders, strategies and expected errors, and the fault injector."""
