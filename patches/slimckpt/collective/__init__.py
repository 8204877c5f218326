"""Agreeing across ranks: every rank of a group ends a collective step the same way."""
