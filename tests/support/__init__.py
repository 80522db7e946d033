"""Test helpers shared across services (real servers for hosted third-party APIs)."""
