"""The STAR training system: one package, one folder per service role."""
