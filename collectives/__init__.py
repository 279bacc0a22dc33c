"""Functional collectives over named mesh axes (simulated and torch.distributed backends)."""
