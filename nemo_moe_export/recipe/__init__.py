"""Recipe glue: stages, hooks, the reference trainer and the synthetic corpus."""
