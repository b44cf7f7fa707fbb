"""The recipe job: its config composed and checked, its stages run, the reference trainer, the synthetic corpus."""
