"""Contracts and plumbing shared by every service: schemas, settings, logging, metrics, Redis."""
