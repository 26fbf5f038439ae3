"""Adapters for TRL and Lightning: optional extras, imported only when used."""
