"""The HF Trainer, TRL SFT and RL trainers with USP, and the rollouts split over a sequence-parallel group."""
