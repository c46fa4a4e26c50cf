"""Persistence: the round checkpoint's file (format, digests, checks), what a fit saves and resumes (the run's record
and every part's state), the byte ledger, and the privacy budget's records."""
